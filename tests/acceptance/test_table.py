"""scripts/acceptance/table.py: a contender whose step ended between two samplings keeps the one
it measured; one that measured nothing has no row; agreements come from the latest run."""

import json

from scripts.acceptance.table import agreements, latest, table


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
