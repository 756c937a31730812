"""The acceptance table from the raw results of every run (results/gpu/acceptance/*/acceptance.json):

    python -m scripts.acceptance.table [RESULTS_DIR]

One row a contender (its latest measurement), acceptance length greedy and at temperature 0.7
(generated tokens per verify step, from SGLang's counters), tokens per second with one request,
and each against the mean of the draft trained on our bf16 dump (the `ours-seed*` rows, whose
spread is the run's noise). A contender whose step ended before every sampling was measured
shows the samplings it has, "-" for the rest. Then each contender over its seeds (`anchor`,
`anchor-seed2`: the anchor), their mean and spread beside ours. Then the agreement of our export with each
reference capture of the same records, where a run measured it.
"""

import argparse
import json
import re
import statistics
from pathlib import Path

from scripts.paths import REPO_ROOT

RESULTS = REPO_ROOT / "results" / "gpu" / "acceptance"
SAMPLINGS = ("greedy", "temperature-0.7")


def latest(results: Path) -> dict:
    rows = {}
    for path in sorted(results.glob("*/acceptance.json")):
        for name, result in json.loads(path.read_text())["contenders"].items():
            if result.get("samplings"):
                rows[name] = dict(result, run=path.parent.name)
    return rows


def agreements(results: Path) -> dict:
    """reference -> its latest agreement with our export, with the run it comes from."""
    found = {}
    for path in sorted(results.glob("*/acceptance.json")):
        for source, record in json.loads(path.read_text()).get("agreement", {}).items():
            if "samples" in record:
                found[source] = dict(record, run=path.parent.name)
    return found


def agreement_table(found: dict) -> str:
    lines = ["| our bf16 export against | run | samples | tokens equal | aux_hidden_state bit-equal | relative | "
             "hidden_state bit-equal | relative |", "|---|---|---|---|---|---|---|---|"]
    for source, record in found.items():
        aux, last = record["aux_hidden_state"], record["hidden_state"]
        lines.append(f"| {source} | {record['run']} | {record['samples']} | "
                     f"{record['samples'] - len(record['token_mismatches'])} | {aux['bit_equal']:.3f} | "
                     f"{aux['relative']:.4f} | {last['bit_equal']:.3f} | {last['relative']:.4f} |")
    return "\n".join(lines)


def table(rows: dict) -> str:
    ours = [rows[name] for name in sorted(rows) if name.startswith("ours-seed")]
    mean = {s: statistics.fmean(r["samplings"][s]["accept_length"] for r in ours if s in r["samplings"])
            for s in SAMPLINGS if any(s in r["samplings"] for r in ours)}
    lines = ["| contender | run | greedy | vs ours | temperature 0.7 | vs ours | tokens/s (1 request, greedy) |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        cells = [name, row["run"]]
        for sampling in SAMPLINGS:
            if sampling not in row["samplings"]:
                cells += ["-", "-"]
                continue
            value = row["samplings"][sampling]["accept_length"]
            cells += [f"{value:.3f}", f"{(value / mean[sampling] - 1) * 100:+.1f}%" if sampling in mean else ""]
        cells.append(f"{row['samplings']['greedy']['tokens_per_s_one_request']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    seeds = {s: [r["samplings"][s]["accept_length"] for r in ours if s in r["samplings"]] for s in SAMPLINGS}
    spread = {s: f"{max(values) - min(values):.3f}" for s, values in seeds.items() if len(values) > 1}
    if spread:
        lines.append("\nSeeds' spread (the noise): " + ", ".join(f"{s} {value}" for s, value in spread.items()) + ".")
    return "\n".join(lines)


def family(name: str) -> str:
    """The contender a row is a seed of: `anchor-seed2` and `anchor` are both the anchor."""
    return re.sub(r"-seed[0-9]+$", "", name)


def seeds_table(rows: dict) -> str:
    """Each contender over its seeds: how many, the mean, the spread (largest less smallest),
    and the mean against ours. A difference inside both spreads is not a measured one."""
    families: dict = {}
    for name, row in rows.items():
        families.setdefault(family(name), []).append(row)
    ours = families.get("ours", [])
    lines = ["| contender | seeds | greedy mean | spread | vs ours | temperature 0.7 mean | spread | vs ours |",
             "|---|---|---|---|---|---|---|---|"]
    for name, members in families.items():
        cells = [name, str(len(members))]
        for sampling in SAMPLINGS:
            values = [r["samplings"][sampling]["accept_length"] for r in members if sampling in r["samplings"]]
            baseline = [r["samplings"][sampling]["accept_length"] for r in ours if sampling in r["samplings"]]
            if not values:
                cells += ["-", "-", "-"]
                continue
            mean = statistics.fmean(values)
            cells += [f"{mean:.3f} ({len(values)})", f"{max(values) - min(values):.3f}" if len(values) > 1 else "-",
                      f"{(mean / statistics.fmean(baseline) - 1) * 100:+.1f}%" if baseline and name != "ours" else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="?", default=RESULTS)
    results = parser.parse_args(argv).results
    rows = latest(results)
    print(table(rows))
    print("\n" + seeds_table(rows))
    found = agreements(results)
    if found:
        print("\n" + agreement_table(found))


if __name__ == "__main__":
    main()
