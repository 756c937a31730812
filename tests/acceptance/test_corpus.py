"""The acceptance target's corpus and what the pipeline sends: this machine's corpus is the one the
committed target was trained on (its splits' digests, recorded on the GPU machine), the splits
never share a file, and the held-out prompts come only from the prompts split."""

import json
import tarfile

import pytest

from scripts.acceptance import corpus, data
from scripts.acceptance.run import MODEL_FILES, TARGET_RESULTS
from scripts.toolchain.errors import ToolError


@pytest.fixture(scope="module")
def recorded():
    return json.loads((TARGET_RESULTS / "target.json").read_text())["corpus"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The committed target's own tokenizer."""
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("target-files")
    with tarfile.open(TARGET_RESULTS / MODEL_FILES) as tar:
        tar.extract("tokenizer.json", folder, filter="data")
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_this_machine_reads_the_corpus_the_target_learned(recorded):
    corpus.check(recorded)  # raises if a split's files or bytes differ
    assert recorded["packages"] == [{"name": "transformers", "version": "5.8.1", "license": "Apache 2.0 License"}]


def test_a_corpus_that_differs_is_refused(recorded):
    changed = json.loads(json.dumps(recorded))
    changed["splits"]["valid"]["sha256"] = "0" * 64
    with pytest.raises(ToolError, match="differs from the one the target was trained on"):
        corpus.check(changed)


def test_the_splits_share_no_file():
    paths = {name: {f.path for f in corpus.split(name)} for name in corpus.SPLITS}
    assert all(paths.values())
    assert not paths["train"] & paths["valid"] and not paths["train"] & paths["prompts"]
    assert not paths["valid"] & paths["prompts"]


def test_held_out_prompts_come_from_the_prompts_split(tokenizer):
    prompts = data.held_out_prompts(tokenizer, 64, 128)
    held_out = {f.path for f in corpus.split("prompts")}
    assert len(prompts) == 64 and len({p["id"] for p in prompts}) == 64
    assert all(p["id"].rsplit("@", 1)[0] in held_out and len(p["input_ids"]) == 128 for p in prompts)
    assert data.held_out_prompts(tokenizer, 64, 128) == prompts  # the same on every run
