"""scripts/acceptance/agreement.py: equal features compare bit-equal, and one changed element,
or other tokens, is seen."""

import torch

from scripts.acceptance.agreement import compare
from scripts.dumps.export_specforge import sample_path, save


def write(folder, idx, tokens, aux, last):
    path = sample_path(folder, idx)
    path.parent.mkdir(parents=True, exist_ok=True)
    save({"input_ids": tokens, "loss_mask": torch.ones_like(tokens), "aux_hidden_state": aux,
          "hidden_state": last}, path, compress=False)


def features(seed):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (12,), generator=generator)
    aux = torch.randn(1, 12, 3 * 8, generator=generator).to(torch.bfloat16)
    last = torch.randn(1, 12, 8, generator=generator).to(torch.bfloat16)
    return tokens, aux, last


def test_equal_features_are_bit_equal(tmp_path):
    for idx in range(3):
        write(tmp_path / "a", idx, *features(idx))
        write(tmp_path / "b", idx, *features(idx))
    result = compare(tmp_path / "a", tmp_path / "b", 8)
    assert result["samples"] == 3 and result["token_mismatches"] == []
    assert result["aux_hidden_state"]["bit_equal"] == 1.0 and result["aux_hidden_state"]["max_abs"] == 0.0
    assert result["hidden_state"]["relative"] == 0.0


def test_one_changed_element_and_other_tokens_are_seen(tmp_path):
    for idx in range(3):
        tokens, aux, last = features(idx)
        write(tmp_path / "a", idx, tokens, aux, last)
        if idx == 1:
            aux = aux.clone()
            aux[0, 5, 7] += 1.0
        if idx == 2:
            tokens = tokens.clone()
            tokens[0] += 1
        write(tmp_path / "b", idx, tokens, aux, last)
    result = compare(tmp_path / "a", tmp_path / "b", 8)
    assert result["token_mismatches"] == [2]
    assert result["samples"] == 3
    assert 0.99 < result["aux_hidden_state"]["bit_equal"] < 1.0
    assert result["aux_hidden_state"]["max_abs"] >= 0.99
    assert result["hidden_state"]["bit_equal"] == 1.0


def test_samples_pair_by_record_not_by_position(tmp_path):
    """The export numbers samples in the order requests finished, a reference in the records'
    order: compared by position they differ, paired through the samples file they are equal."""
    import json

    from scripts.acceptance.agreement import record_pairs

    order = [2, 0, 1]  # the export's idx n holds record line order[n] + 1
    (tmp_path / "dump").mkdir()
    (tmp_path / "ours").mkdir()
    (tmp_path / "dump" / "samples.jsonl").write_text(
        "".join(json.dumps({"rid": f"r{line}", "line": line + 1}) + "\n" for line in order))
    (tmp_path / "ours" / "export.jsonl").write_text(
        "".join(json.dumps({"idx": idx, "rid": f"r{line}"}) + "\n" for idx, line in enumerate(order)))
    for idx, line in enumerate(order):
        write(tmp_path / "ours", idx, *features(line))
        write(tmp_path / "theirs", line, *features(line))
    assert compare(tmp_path / "ours", tmp_path / "theirs", 8)["token_mismatches"] == [0, 1, 2]
    pairs = record_pairs(tmp_path / "ours", tmp_path / "dump")
    assert pairs == {0: 2, 1: 0, 2: 1}
    result = compare(tmp_path / "ours", tmp_path / "theirs", 8, pairs)
    assert result["samples"] == 3 and result["token_mismatches"] == []
    assert result["aux_hidden_state"]["bit_equal"] == 1.0
