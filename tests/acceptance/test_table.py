"""scripts/acceptance/table.py: a contender whose step ended between two samplings keeps the one
it measured; one that measured nothing has no row; agreements come from the latest run."""

import json

from scripts.acceptance.table import agreements, latest, seeds_table, table


def sampling(value):
    return {"accept_length": value, "tokens_per_s_one_request": 100.0}


def write_run(results, name, contenders, agreement=None):
    (results / name).mkdir(parents=True)
    (results / name / "acceptance.json").write_text(json.dumps(
        {"contenders": contenders, **({"agreement": agreement} if agreement else {})}))


def test_partial_rows_and_the_latest_agreement(tmp_path):
    both = {"greedy": sampling(1.7), "temperature-0.7": sampling(1.6)}
    write_run(tmp_path, "run-a", {"ours-seed1": {"status": "measured", "samplings": both},
                                  "ours-seed2": {"status": "measured", "samplings": {
                                      "greedy": sampling(1.72), "temperature-0.7": sampling(1.64)}}},
              {"x": {"status": "failed", "error": "e"}})
    agreement = {"samples": 4, "token_mismatches": [], "aux_hidden_state": {"bit_equal": 0.5, "relative": 0.01},
                 "hidden_state": {"bit_equal": 0.25, "relative": 0.02}}
    write_run(tmp_path, "run-b", {"anchor": {"status": "measured greedy; measuring",
                                             "samplings": {"greedy": sampling(1.8)}},
                                  "fp8": {"status": "failed at specforge train"}},
              {"x": agreement})
    rows = latest(tmp_path)
    assert sorted(rows) == ["anchor", "ours-seed1", "ours-seed2"]
    text = table(rows)
    anchor = next(line for line in text.splitlines() if line.startswith("| anchor"))
    assert anchor.split(" | ")[2:6] == ["1.800", "+5.3%", "-", "-"]
    assert "greedy 0.020, temperature-0.7 0.040" in text
    assert agreements(tmp_path) == {"x": dict(agreement, run="run-b")}


def test_seeds_of_a_contender_are_summed_up_beside_ours():
    rows = {"ours-seed1": {"samplings": {"greedy": sampling(1.6), "temperature-0.7": sampling(1.5)}},
            "ours-seed2": {"samplings": {"greedy": sampling(1.8), "temperature-0.7": sampling(1.7)}},
            "anchor": {"samplings": {"greedy": sampling(1.9)}},
            "anchor-seed2": {"samplings": {"greedy": sampling(2.1), "temperature-0.7": sampling(1.8)}},
            "untrained": {"samplings": {"greedy": sampling(1.0)}}}
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in seeds_table(rows).splitlines()[2:]]
    lines = {row[0]: row[1:] for row in cells}
    assert lines["ours"][:4] == ["2", "1.700 (2)", "0.200", ""]
    assert lines["anchor"][:7] == ["2", "2.000 (2)", "0.200", "+17.6%", "1.800 (1)", "-", "+12.5%"]
    assert lines["untrained"][:5] == ["1", "1.000 (1)", "-", "-41.2%", "-"]


def test_contender_names_carry_their_seed_and_bad_ones_are_refused():
    import pytest

    from scripts.acceptance.contenders import SPECFORGE_CAPTURE, Contender, contender_named
    from scripts.toolchain.errors import ToolError

    assert contender_named("anchor") == Contender(SPECFORGE_CAPTURE, 1)
    assert contender_named("anchor-seed3") == Contender(SPECFORGE_CAPTURE, 3)
    assert contender_named("ours-seed4") == Contender("bf16", 4)
    assert contender_named("untrained") == Contender(None)
    for bad in ("ours", "untrained-seed2", "anchor-seed0", "anchor-seed", "Anchor", "fp16"):
        with pytest.raises(ToolError, match=f"no contender {bad};"):
            contender_named(bad)
