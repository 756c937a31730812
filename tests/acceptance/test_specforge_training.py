"""The acceptance pipeline's training stage on the CPU: a real server dumps plain text records
through `generate`, `export_specforge --draft-config` exports them, and SpecForge's own trainer
(its command line, its EAGLE-3 draft and loss; only the loss's Triton kernel in PyTorch,
tests/acceptance/specforge_cpu.py) trains a draft on the export and `specforge export` writes
the folder SGLang would serve. The loss must fall on the same batch; with a learning rate of
1e-9 it must not (the control). A draft config that would be fed other layers than the export holds
is refused before anything is written, so no trainer ever starts on it.

The release SpecForge 0.2.0 pins (0.5.14) runs this: make test-acceptance."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.acceptance import specforge_training
from scripts.dump_format import read_manifest
from scripts.dumps.server import STARTUP_TIMEOUT_S, runtime_env
from scripts.dumps.tiny_model import ensure_model
from scripts.dumps.tiny_tokenizer import CORPUS

DUMP_LAYERS = [2, 3, 4]  # below L = 5: what an EAGLE-3 draft is fed (it takes three)
STEPS = 8
FALL = 0.1  # of the loss over the steps (seen: 16.92 to 16.68)
CPU_TRAINER = [sys.executable, "-m", "tests.acceptance.specforge_cpu"]
# The CPU: no FSDP (it refuses the CPU), PyTorch's attention, both samples in every batch, so
# every step sees the same batch.
TRAINING = {"strategy": "eagle3", "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "batch_size": 2,
            "max_steps": STEPS, "num_epochs": STEPS, "ttt_length": 3, "log_interval": 1, "save_interval": 0,
            "dataloader_num_workers": 0}


def environment():
    # The servers and trainers run SGLang's and SpecForge's torch.compile'd helpers eagerly, as
    # tests/server/conftest.py explains.
    return runtime_env(TORCHDYNAMO_DISABLE="1")


@pytest.fixture(scope="module")
def model():
    return ensure_model(layers=5, q_lora=False)


@pytest.fixture(scope="module")
def dump(model, tmp_path_factory):
    """Two plain text records dumped by generate on a real server."""
    work = tmp_path_factory.mktemp("specforge-training")
    lines = [line for line in CORPUS.read_text().splitlines() if len(line) > 40]
    records = work / "records.jsonl"
    records.write_text("".join(json.dumps({"id": f"text-{n}", "text": "\n".join(lines[n * 6:(n + 1) * 6])}) + "\n"
                               for n in range(2)))
    out = work / "dump"
    subprocess.run([sys.executable, "-m", "scripts.dumps.generate", "--dataset", str(records), "--out", str(out),
                    "--model", str(model), "--dump-layers", ",".join(map(str, DUMP_LAYERS))],
                   env=environment(), check=True, timeout=STARTUP_TIMEOUT_S + 300)
    return out


def draft_ids(dump_dir: Path):
    """The draft config ids the dump says SGLang feeds its layers (what inspect_dump prints)."""
    return read_manifest(str(dump_dir))[0]["eagle3_draft_layer_ids"][0]


def export(dump_dir: Path, out: Path, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.dumps.export_specforge", str(dump_dir), str(out),
                           "--draft-config", str(config)], env=environment(), capture_output=True, text=True)


def train(model: Path, config: Path, features: Path, work: Path, learning_rate: float):
    run = specforge_training.run_config("smoke", specforge_training.target_folder(model, work / "target"), config,
                                        features, work, 256, dict(TRAINING, learning_rate=learning_rate), seed=1)
    log = work / "train.log"
    specforge_training.train(run, log, timeout=600, launcher=CPU_TRAINER)
    return specforge_training.losses(log)


def test_plain_text_records_are_dumped_whole(dump):
    import torch
    from scripts.dump_format import load_dump

    samples = [json.loads(line) for line in (dump / "samples.jsonl").read_text().splitlines()]
    assert sorted(s["rid"] for s in samples) == ["text-0", "text-1"]  # in the order the server finished them
    for sample in samples:
        record = load_dump(str(dump / sample["sample"]))
        assert sample["loss_mask"] == [0, record.token_ids.numel()]  # run-length: no zeros, then every token
        assert record.layer_ids == DUMP_LAYERS and record.hidden_states.dtype == torch.bfloat16


def test_specforge_trains_on_the_export(model, dump, tmp_path):
    config = specforge_training.draft_config(model, tmp_path / "draft-config", draft_ids(dump))
    features = tmp_path / "export"
    exported = export(dump, features, config)
    assert exported.returncode == 0, exported.stderr
    losses = train(model, config, features, tmp_path / "run", learning_rate=1e-3)
    # The loss is a cross-entropy against the target's distribution, whose entropy (about 6.8
    # nats a step here: a tiny random target) is its floor: it falls at every step, by a little.
    assert len(losses) == STEPS
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - FALL, losses
    draft = specforge_training.export_draft(tmp_path / "run" / "checkpoints", config, tmp_path / "draft",
                                            tmp_path / "export.log", timeout=300)
    served = json.loads((draft / "config.json").read_text())
    assert served["architectures"] == ["LlamaForCausalLMEagle3"]
    assert served["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == draft_ids(dump)
    from safetensors import safe_open

    with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("fc.weight").get_shape() == [served["hidden_size"], 3 * served["hidden_size"]]


def test_control_no_learning_no_fall(model, dump, tmp_path):
    config = specforge_training.draft_config(model, tmp_path / "draft-config", draft_ids(dump))
    features = tmp_path / "export"
    assert export(dump, features, config).returncode == 0
    # SpecForge refuses a learning rate of 0; one of 1e-9 moves no weight measurably.
    losses = train(model, config, features, tmp_path / "run", learning_rate=1e-9)
    assert len(losses) == STEPS
    assert max(losses) - min(losses) < FALL / 10, losses


def test_draft_config_of_other_layers_refused_before_anything_is_written(model, dump, tmp_path):
    shifted = [layer_id + 1 for layer_id in draft_ids(dump)]
    config = specforge_training.draft_config(model, tmp_path / "draft-config", shifted)
    features = tmp_path / "export"
    refused = export(dump, features, config)
    assert refused.returncode == 1
    assert f"names {json.dumps(shifted)}" in refused.stderr and str(DUMP_LAYERS) in refused.stderr, refused.stderr
    assert not features.exists()  # nothing a trainer could start on
