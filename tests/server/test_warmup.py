"""make test-warmup: a real server does its warmup and one prefill with dumping on.

The dumped values must equal SGLang's own computation taken independently (forward hooks,
tests/server/oracle_hooks.py), and the layer-0 capture transformers' embedding output.
Kimi-K2.5, the seed's model, serves DeepSeek-V3 inside a multimodal wrapper: its file must
equal the hooks' and the plain DeepSeek-V3's.
Negative controls: the naive patch must fail the same warmup check, and invalid settings
must stop the server at startup with a clear message.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scripts.dump_format import load_dump
from tests.server.dump_checks import relative_error, run_one_prefill
from scripts.paths import REPO_ROOT
from scripts.dumps.server import STALL_TIMEOUT_S, Server, ServerFailed, runtime_env
from scripts.toolchain.lock import load_lock

# A server that must fail or refuse at startup is waited for until it does, as long as it
# makes progress (STALL_TIMEOUT_S): with three other servers on the two cores a naive server
# had not crashed after 300 s. This bound only ends a wait that would never end.
LOADED_START_LIMIT_S = 1800

# What every release runs here: warmup and a dump equal to SGLang's own values, the Kimi-K2.5
# wrapper (its model file differs by release) and the seed's naive patch failing. The rest
# checks what the same code does on every release: the overlay's config module picks the
# default layers and refuses bad settings (tests/unit/test_dump_config.py checks each
# message), one hook of the series calls it at startup, and the series check names whichever
# patch is missing. Those run on the default release, whose whole server suite CI runs.
ON_THE_DEFAULT_RELEASE = pytest.mark.skipif(
    os.environ.get("SGLANG_VERSION") != load_lock().default,
    reason="the same overlay code on every release; run with the default release's server suite",
)


def eagle3_default_layers(num_layers: int):
    return sorted({min(max(i, 0), num_layers) for i in (3, num_layers // 2 + 1, num_layers - 2)})


def check_dump(prompt, dump_dir, manifest, streams, layers, hidden_size):
    assert len(manifest) == 1, manifest
    entry = manifest[0]
    assert entry["num_tokens"] == len(prompt)
    assert entry["layers"] == layers
    assert entry["hidden_size"] == hidden_size and entry["dtype"] == "bfloat16"
    files = sorted(p.name for p in dump_dir.iterdir() if p.suffix == ".safetensors")
    assert files == [entry["file"]], "exactly one complete file, named in the manifest"
    record = load_dump(str(dump_dir / entry["file"]))
    assert record.metadata["rid"] == entry["rid"]
    assert record.layer_ids == layers
    assert record.metadata["sglang_version"] and record.metadata["series_version"]
    assert record.token_ids.dtype == torch.int64 and record.token_ids.tolist() == prompt
    assert record.hidden_states.shape == (len(prompt), len(layers), hidden_size)
    assert record.hidden_states.dtype == torch.bfloat16
    assert record.last_hidden_state.shape == (len(prompt), hidden_size)
    for k, layer_id in enumerate(layers):
        expected = streams[str(layer_id)]
        assert expected.norm() > 0
        error = relative_error(record.hidden_states[:, k], expected)
        assert error <= 1e-2, f"layer {layer_id}: relative error {error:.3g} against SGLang's own value"
    assert relative_error(record.last_hidden_state, streams["last"]) <= 1e-2
    return record


def test_every_capture_point_in_configured_order(model_l3, tmp_path):
    layers = [3, 0, 2, 1]  # L, the embedding, and the ones between, in an order of our choosing
    prompt, dump_dir, manifest, streams = run_one_prefill(
        model_l3, tmp_path, 3, ",".join(map(str, layers)), prompt_len=37)
    record = check_dump(prompt, dump_dir, manifest, streams, layers, hidden_size=256)

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_l3, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        embedding = reference.model.embed_tokens(torch.tensor(prompt))
    assert torch.equal(record.hidden_states[:, layers.index(0)], embedding)


@ON_THE_DEFAULT_RELEASE
def test_default_layers_without_q_lora(model_l5_no_q_lora, tmp_path):
    prompt, dump_dir, manifest, streams = run_one_prefill(
        model_l5_no_q_lora, tmp_path, 5, None, prompt_len=53)
    check_dump(prompt, dump_dir, manifest, streams, eagle3_default_layers(5), hidden_size=256)


def kimi_k25_server_settings():
    """The flags and environment a server of the reduced Kimi-K2.5 needs on this release."""
    from sglang.srt.server_args import ServerArgs

    # SGLang loads a multimodal model's processor even with --skip-tokenizer-init, and from
    # 0.5.14 on builds its Kimi-K2.5 one from the checkpoint's processor, which is code in
    # the checkpoint (scripts/dumps/tiny_kimi_processor.py), as Kimi-K2.5's own is.
    extra_args = ["--trust-remote-code"]
    env = {}
    # 0.5.9 refuses every multimodal model on torch 2.9.1 with a cuDNN older than 9.15 (a
    # Conv3d slowdown in vision towers), even on the CPU; later releases have no such check.
    if hasattr(ServerArgs, "check_torch_2_9_1_cudnn_compatibility"):
        env["SGLANG_DISABLE_CUDNN_CHECK"] = "1"
    return extra_args, env


def test_kimi_k25_dumps_its_text_model(kimi_k25_l2, model_l2, tmp_path):
    """KimiK25ForConditionalGeneration builds DeepseekV3ForCausalLM from config.text_config as
    its `language_model` and runs it on input embeddings (general_mm_embed_routine), not token
    ids. The default ids come from the text model's L=2 layers ([0, 2]; the one-layer vision
    tower's would be [0, 1]), so the file holds the embeddings the wrapper passed in and the
    last layer's output. It equals the hooks' values, and (on the default release: the plain
    model's path is the capture-order test's, which every release runs) bit for bit the file of
    the plain DeepSeek-V3 model whose weights the text model has, for the same prompt."""
    layers = eagle3_default_layers(2)
    assert layers == [0, 2]
    extra_args, env = kimi_k25_server_settings()
    (tmp_path / "kimi").mkdir()
    prompt, dump_dir, manifest, streams = run_one_prefill(
        kimi_k25_l2, tmp_path / "kimi", 2, None, prompt_len=41,
        extra_args=extra_args, decoder="language_model.model", **env)
    kimi = check_dump(prompt, dump_dir, manifest, streams, layers, hidden_size=256)
    embedding = load_file(kimi_k25_l2 / "model.safetensors")["language_model.model.embed_tokens.weight"]
    assert torch.equal(kimi.hidden_states[:, layers.index(0)], embedding[prompt])
    if os.environ.get("SGLANG_VERSION") != load_lock().default:
        return

    (tmp_path / "plain").mkdir()
    plain_prompt, plain_dir, plain_manifest, _ = run_one_prefill(model_l2, tmp_path / "plain", 2, None, prompt_len=41)
    plain = load_dump(str(plain_dir / plain_manifest[0]["file"]))
    assert plain_prompt == prompt and plain.layer_ids == kimi.layer_ids
    assert torch.equal(kimi.token_ids, plain.token_ids)
    assert torch.equal(kimi.hidden_states, plain.hidden_states)
    assert torch.equal(kimi.last_hidden_state, plain.last_hidden_state)


def test_naive_patch_fails_the_warmup_check(model_l3, naive_tree, tmp_path):
    """The seed's failure, on every release: no id of [3, 31, 59] lies below L=3, nothing is
    captured, the model returns a bare tensor and the forward's unpack raises."""
    with Server(model_l3, tmp_path / "server.log", runtime_env(tree=naive_tree)) as server:
        with pytest.raises(ServerFailed, match="too many values to unpack"):
            server.wait_ready(timeout=LOADED_START_LIMIT_S, stall_timeout=STALL_TIMEOUT_S)


@pytest.mark.skipif(
    tuple(map(int, os.environ["SGLANG_VERSION"].split("."))) < (0, 5, 23),
    reason="upstream packs aux hidden states into an AuxHiddenStatePacker from 0.5.23 on",
)
def test_naive_patch_fails_on_a_deeper_model_with_upstreams_packer(model_l5_no_q_lora, naive_tree, tmp_path):
    """0.5.23's failure on a model deep enough to reach one of the naive ids: with L=5 only
    layer 3 of [3, 31, 59] is captured, and the packer refuses a partial capture at warmup."""
    with Server(model_l5_no_q_lora, tmp_path / "server.log", runtime_env(tree=naive_tree)) as server:
        with pytest.raises(ServerFailed, match="captured 1 of 3 aux hidden states"):
            server.wait_ready(timeout=LOADED_START_LIMIT_S, stall_timeout=STALL_TIMEOUT_S)


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("SGLANG_HS_DUMP_LAYERS", "1,4", r"\[4\] out of range; the model has L=3 layers, so valid ids are 0..3"),
        ("SGLANG_HS_DUMP_DIR", "{tmp}/a-file/dump", "is not a writable directory"),
        ("SGLANG_HS_DUMP_DTYPE", "int4", r"SGLANG_HS_DUMP_DTYPE='int4': use one of bf16, fp8"),
        ("SGLANG_HS_DUMP_SAMPLE", "1.5", r"SGLANG_HS_DUMP_SAMPLE=1.5: give the fraction of requests dumped, from 0"),
    ],
)
@ON_THE_DEFAULT_RELEASE
def test_invalid_settings_stop_the_server_at_startup(model_l3, tmp_path, variable, value, message):
    (tmp_path / "a-file").write_text("not a directory")
    extra = {"SGLANG_HS_DUMP_DIR": str(tmp_path / "dump"), variable: value.format(tmp=tmp_path)}
    with Server(model_l3, tmp_path / "server.log", runtime_env(**extra)) as server:
        code = server.wait_exit(timeout=LOADED_START_LIMIT_S, stall_timeout=STALL_TIMEOUT_S)
        log = server.log()
    assert code != 0
    assert re.search(message, log), log[-3000:]
    assert "ready to roll" not in log


def series_patch(concern: str) -> Path:
    """This release's patch for `concern` (its name after the number)."""
    series = REPO_ROOT / "patches" / f"v{os.environ['SGLANG_VERSION']}"
    names = [name for name in (series / "series").read_text().split() if name.split("-", 1)[1] == f"{concern}.patch"]
    if not names:
        pytest.skip(f"SGLang {os.environ['SGLANG_VERSION']}'s series has no patch for {concern}")
    return series / names[0]


@pytest.fixture
def tree_without(request, tmp_path):
    """A scratch copy of the patched checkout with one patch of the series taken out."""
    patch = series_patch(request.param)
    checkout = Path(os.environ["SGLANG_CHECKOUT"])
    tree = tmp_path / "without"
    subprocess.run(["git", "-C", checkout, "worktree", "add", "--detach", "-q", tree, "HEAD"], check=True)
    subprocess.run(["git", "-C", tree, "apply", "-R", patch], check=True)
    yield tree
    subprocess.run(["git", "-C", checkout, "worktree", "remove", "--force", tree], check=True)


@pytest.mark.parametrize(
    "tree_without",
    ["prefill-cuda-graph-runs-dumped-prefills-eagerly", "drain-the-dump-before-a-scheduler-process-goes"],
    indirect=True,
)
@ON_THE_DEFAULT_RELEASE
def test_a_series_without_a_patch_the_dump_relies_on_refuses_to_start(model_l3, tree_without, tmp_path, request):
    """A port that skipped one of these patches would lose dumps silently (a prefill replayed
    from a CUDA graph runs no hook; a stopping server kills the writer's queue): with
    dumping on, the server must refuse to start, naming the patch. The whole series with
    dumping on serves in the other tests here, so the missing patch is what it refuses."""
    concern = request.node.callspec.params["tree_without"]
    env = runtime_env(tree=tree_without, SGLANG_HS_DUMP_DIR=str(tmp_path / "dump"))
    with Server(model_l3, tmp_path / "server.log", env) as server:
        code = server.wait_exit(timeout=LOADED_START_LIMIT_S, stall_timeout=STALL_TIMEOUT_S)
        log = server.log()
    assert code != 0
    assert re.search(rf"lacks series patches the hidden states dump relies on: {concern} ", log), log[-3000:]
    assert "ready to roll" not in log
