"""The acceptance table from the raw results of every run (results/gpu/acceptance/*/acceptance.json):

    python -m scripts.acceptance.table [RESULTS_DIR]

One row a contender (its latest measurement), acceptance length greedy and at temperature 0.7
(generated tokens per verify step, from SGLang's counters), tokens per second with one request,
and each against the mean of the draft trained on our bf16 dump (the `ours-seed*` rows, whose
spread is the run's noise).
"""

import argparse
import json
import statistics
from pathlib import Path

from scripts.paths import REPO_ROOT

RESULTS = REPO_ROOT / "results" / "gpu" / "acceptance"
SAMPLINGS = ("greedy", "temperature-0.7")


def latest(results: Path) -> dict:
    rows = {}
    for path in sorted(results.glob("*/acceptance.json")):
        for name, result in json.loads(path.read_text())["contenders"].items():
            if result.get("status") == "measured":
                rows[name] = dict(result, run=path.parent.name)
    return rows


def table(rows: dict) -> str:
    ours = [rows[name] for name in sorted(rows) if name.startswith("ours-seed")]
    mean = {s: statistics.fmean(r["samplings"][s]["accept_length"] for r in ours) for s in SAMPLINGS} if ours else {}
    lines = ["| contender | run | greedy | vs ours | temperature 0.7 | vs ours | tokens/s (1 request, greedy) |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        cells = [name, row["run"]]
        for sampling in SAMPLINGS:
            value = row["samplings"][sampling]["accept_length"]
            cells += [f"{value:.3f}", f"{(value / mean[sampling] - 1) * 100:+.1f}%" if mean else ""]
        cells.append(f"{row['samplings']['greedy']['tokens_per_s_one_request']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    if len(ours) > 1:
        spread = {s: max(r["samplings"][s]["accept_length"] for r in ours) -
                  min(r["samplings"][s]["accept_length"] for r in ours) for s in SAMPLINGS}
        lines.append(f"\nSeeds' spread (the noise): greedy {spread['greedy']:.3f}, "
                     f"temperature 0.7 {spread['temperature-0.7']:.3f}.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="?", default=RESULTS)
    print(table(latest(parser.parse_args(argv).results)))


if __name__ == "__main__":
    main()
