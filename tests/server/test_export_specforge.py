"""scripts/dumps/export_specforge.py on a real dump: the values round-trip, the layout is
SpecForge's, and SpecForge's own offline readers load it (specforge 0.2.0, installed without
its dependencies by requirements/trainers.txt: its readers need only torch)."""

import json

import pytest
import torch

from scripts.dump_format import load_dump, read_manifest
from scripts.dumps import export_specforge
from scripts.dumps.draft_config import VALUES_NAME
from scripts.dumps.exporting import INDEX_NAME
from scripts.dumps.samples import SAMPLES_NAME, samples_line
from tests.server.dump_checks import EXPORT_DUMP_LAYERS

FED = [0, 2]  # the dump's layers below L, ascending: what SGLang feeds the draft


def test_round_trip(export_dump, tmp_path):
    out = tmp_path / "out"
    assert export_specforge.main([str(export_dump), str(out)]) == 0
    entries = read_manifest(str(export_dump))
    index = [json.loads(line) for line in (out / INDEX_NAME).read_text().splitlines()]
    assert [(i["idx"], i["rid"], i["file"]) for i in index] == [(n, e["rid"], e["file"]) for n, e in enumerate(entries)]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.ckpt")) == \
        sorted(f"rows_0-2000/data_{n}.ckpt" for n in range(len(entries)))
    for n, entry in enumerate(entries):
        record = load_dump(str(export_dump / entry["file"]))
        sample = torch.load(out / "rows_0-2000" / f"data_{n}.ckpt")
        num_tokens, _, hidden_size = record.hidden_states.shape
        num_layers = len(FED)
        assert sorted(sample) == ["aux_hidden_state", "hidden_state", "input_ids", "loss_mask"]
        assert sample["input_ids"].dtype == sample["loss_mask"].dtype == torch.long
        assert torch.equal(sample["input_ids"], record.token_ids)
        assert torch.equal(sample["loss_mask"], torch.ones(num_tokens, dtype=torch.long))
        assert sample["hidden_state"].shape == (1, num_tokens, hidden_size)
        assert torch.equal(sample["hidden_state"][0], record.last_hidden_state)
        assert sample["aux_hidden_state"].shape == (1, num_tokens, num_layers * hidden_size)
        assert sample["aux_hidden_state"].dtype == record.hidden_states.dtype == torch.bfloat16
        for k, layer in enumerate(FED):  # layers side by side, ascending
            assert torch.equal(sample["aux_hidden_state"][0, :, k * hidden_size:(k + 1) * hidden_size],
                               record.hidden_states[:, EXPORT_DUMP_LAYERS.index(layer)])


def test_folders_of_2000(tmp_path):
    assert export_specforge.sample_path(tmp_path, 1999) == tmp_path / "rows_0-2000" / "data_1999.ckpt"
    assert export_specforge.sample_path(tmp_path, 2000) == tmp_path / "rows_2000-4000" / "data_2000.ckpt"


def test_loss_masks_from_the_samples_file(export_dump, tmp_path, capsys):
    entries = read_manifest(str(export_dump))
    masks = {e["rid"]: [n % 2 for n in range(e["num_tokens"])] for e in entries}
    files = {e["rid"]: e["file"] for e in entries}
    path = tmp_path / SAMPLES_NAME

    def write_samples():
        path.write_text("".join(json.dumps(samples_line(rid, n, mask, files[rid])) + "\n"
                                for n, (rid, mask) in enumerate(masks.items())))

    write_samples()
    assert export_specforge.main([str(export_dump), str(tmp_path / "out"), "--samples", str(path)]) == 0
    for n, entry in enumerate(entries):
        sample = torch.load(tmp_path / "out" / "rows_0-2000" / f"data_{n}.ckpt")
        assert sample["loss_mask"].tolist() == masks[entry["rid"]]

    masks["export-2"] = masks["export-2"][:-1]
    write_samples()
    assert export_specforge.main([str(export_dump), str(tmp_path / "bad"), "--samples", str(path)]) == 1
    assert "the loss mask of 'export-2' has 63 values, its dump has 64 tokens" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # checked before anything is written


def test_specforge_reads_the_export(export_dump, tmp_path):
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    out = tmp_path / "out"
    export_specforge.main([str(export_dump), str(out)])
    records = {n: load_dump(str(export_dump / e["file"])) for n, e in enumerate(read_manifest(str(export_dump)))}

    def idx(path):
        return int(str(path).rsplit("data_", 1)[1].split(".")[0])

    # The reader of SpecForge's EAGLE-3 offline training: aux in, final hidden state as target.
    dataset = build_offline_eagle3_dataset(str(out), max_len=2048)
    assert len(dataset) == len(records)
    for i, path in enumerate(dataset.datapaths):
        record, item = records[idx(path)], dataset[i]
        num_tokens = record.token_ids.numel()
        assert torch.equal(item["input_ids"][0], record.token_ids)
        assert torch.equal(item["target"][0], record.last_hidden_state)
        assert torch.equal(item["hidden_state"][0], fed(record).reshape(num_tokens, -1))
        assert item["loss_mask"][0].tolist() == [1] * (num_tokens - 1) + [0]  # SpecForge masks the last

    # Its manifest reader (SpecForge's newer data plane).
    refs = OfflineManifestReader(str(out), validate_files=True).read()
    assert len(refs) == len(records)
    for ref in refs:
        path = ref.feature_store_uri.removeprefix("file://")
        features, record = load_feature_file(path), records[idx(path)]
        assert ref.num_tokens == record.token_ids.numel()
        assert torch.equal(features["aux_hidden_state"][0], fed(record).reshape(ref.num_tokens, -1))


def fed(record):
    return record.hidden_states[:, [EXPORT_DUMP_LAYERS.index(layer) for layer in FED]]


def test_the_export_says_what_the_draft_config_must_name(export_dump, tmp_path):
    """The ids come from the dump's metadata, which the server computed with the release's
    own set_eagle3_layers_to_capture: a draft config naming them is fed FED."""
    out = tmp_path / "out"
    assert export_specforge.main([str(export_dump), str(out)]) == 0
    values = json.loads((out / VALUES_NAME).read_text())
    record = load_dump(str(export_dump / read_manifest(str(export_dump))[0]["file"]))
    assert values["fed_layers"] == FED
    assert [values["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == record.eagle3_draft_layer_ids[:1]
    assert values["target_hidden_size"] == record.hidden_states.shape[-1]
    assert values["vocab_size"] == json.loads((dump_model_config(record)).read_text())["vocab_size"]


def dump_model_config(record):
    from pathlib import Path

    return Path(record.metadata["model_path"]) / "config.json"


@pytest.mark.parametrize("shift", [1, -1])
def test_a_draft_config_naming_other_layers_is_refused_before_anything_is_written(export_dump, tmp_path, capsys, shift):
    record = load_dump(str(export_dump / read_manifest(str(export_dump))[0]["file"]))
    right = record.eagle3_draft_layer_ids[0]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [i + shift for i in right]}}))

    assert export_specforge.main([str(export_dump), str(tmp_path / "out"), "--draft-config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"A draft fed these layers names {json.dumps(right)}" in err
    assert not (tmp_path / "out").exists()

    # The control: the right ids pass.
    config.write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": right}}))
    assert export_specforge.main([str(export_dump), str(tmp_path / "ok"), "--draft-config", str(config)]) == 0


def test_layers_sglang_would_not_feed_in_that_order_are_refused(export_dump, tmp_path, capsys):
    assert export_specforge.main([str(export_dump), str(tmp_path / "out"), "--layers", "2,0"]) == 1
    assert "Export --layers 0,2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_compressed_files_are_read_by_specforge_as_the_plain_ones(export_dump, tmp_path):
    """--compress writes data_{idx}.ckpt.gz, which both of SpecForge's readers take; what
    they read equals the plain export's."""
    import gzip

    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    plain, compressed = tmp_path / "plain", tmp_path / "compressed"
    assert export_specforge.main([str(export_dump), str(plain)]) == 0
    assert export_specforge.main([str(export_dump), str(compressed), "--compress"]) == 0
    files = sorted(compressed.rglob("data_*"))
    assert [p.name for p in files] == [f"data_{n}.ckpt.gz" for n in range(len(files))] and len(files) == 5
    for path in files:
        with gzip.open(path) as f:
            f.read()  # a whole gzip stream
    print(f"gzip: {sum(p.stat().st_size for p in files):,} bytes, plain: "
          f"{sum(p.stat().st_size for p in plain.rglob('data_*')):,}")

    read_plain, read_compressed = (build_offline_eagle3_dataset(str(d), max_len=2048) for d in (plain, compressed))
    assert len(read_compressed) == len(read_plain) == 5
    for i in range(5):
        a, b = read_plain[i], read_compressed[i]
        assert sorted(a) == sorted(b) and all(torch.equal(a[key], b[key]) for key in a)
    refs = OfflineManifestReader(str(compressed), validate_files=True).read()
    assert sorted(ref.feature_store_uri.removeprefix("file://") for ref in refs) == [str(p) for p in files]
    for path in files:
        plain_file = plain / path.relative_to(compressed).with_suffix("")
        features, expected = load_feature_file(str(path)), torch.load(plain_file)
        assert all(torch.equal(features[key], expected[key]) for key in expected)
