"""A warm GPU machine keeps the pipeline's WORK between steps: features an earlier step finished
are reused, with their record; a folder left halfway is made again."""

import json
from types import SimpleNamespace

from scripts.acceptance.contenders import Pipeline


def pipeline_in(work):
    saved = []
    state = SimpleNamespace(work=work, results={"contenders": {}}, exports={}, save=lambda: saved.append(1))
    for method in ("features_made", "kept_features"):
        setattr(state, method, getattr(Pipeline, method).__get__(state))
    return state


def test_finished_features_are_kept_for_a_later_step(tmp_path):
    features = tmp_path / "export-bf16"
    features.mkdir()
    pipeline_in(tmp_path).features_made("bf16", features, {"dump_s": 65.0})

    later = pipeline_in(tmp_path)
    assert later.kept_features("bf16", features)
    assert later.exports == {"bf16": features}
    assert later.results["dumps"]["bf16"] == {"dump_s": 65.0, "kept_from_an_earlier_step": True}


def test_a_folder_left_halfway_is_made_again(tmp_path):
    features = tmp_path / "export-bf16"
    features.mkdir()
    (features / "data_0.ckpt").write_bytes(b"half")
    later = pipeline_in(tmp_path)
    assert not later.kept_features("bf16", features)
    assert later.exports == {} and "dumps" not in later.results
    # the record without its folder is not enough either
    (tmp_path / "export-fp8.done.json").write_text(json.dumps({"dump_s": 1}))
    assert not later.kept_features("fp8", tmp_path / "export-fp8")
