"""What the server tests of the dump share: workloads, one prefill with the oracle's hooks,
the comparison of a file with the oracle, and reading the dump's counters from the server log."""

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from scripts.dump_format import META_INFO_KEY, DumpCounters, DumpRecord
from scripts.dumps.server import Server, has_gpu, runtime_env, wait_for_manifest
from tests.server import oracle_hooks

# The release under test: upstream's behaviour around the dump differs between releases.
RELEASE = tuple(int(part) for part in os.environ["SGLANG_VERSION"].split("."))
VOCAB_SIZE = 1024  # scripts.dumps.tiny_model
# Every generated token is this one (a logit bias), and no prompt holds it: a decode row is
# never mistaken for a prompt row by the oracle.
OUTPUT_TOKEN = 3
FIRST_PROMPT_TOKEN = 4
# Per row, the dump's value against the oracle's relative error. On the CPU they are equal
# bit for bit; on a GPU the capture takes the fused add-norm's residual where the oracle
# adds in bf16 itself.
ROW_TOLERANCE = 0.0 if not has_gpu() else 1e-2


class OracleServer(Server):
    """A server (not started) that dumps into tmp_path/dump while the oracle's hooks record
    into tmp_path/oracle, its oracle_dir, on the decoder at module path `decoder` (decode-only
    forwards too with `record_decode`; under tensor parallelism on rank `oracle_rank` alone;
    the experts of `moe_layers` too)."""

    def __init__(self, model, tmp_path, num_layers: int, extra_args: Sequence[str] = (), decoder: str = "model",
                 extra_hooks: Sequence[dict] = (), record_decode: bool = False, oracle_rank: Optional[int] = None,
                 moe_layers: Sequence[int] = (), **env):
        self.oracle_dir = tmp_path / "oracle"
        self.oracle_dir.mkdir()
        specs = oracle_hooks.hook_specs(self.oracle_dir, num_layers, decoder, decode=record_decode, rank=oracle_rank,
                                        moe_layers=moe_layers)
        hooks = json.dumps(specs + list(extra_hooks))
        super().__init__(model, tmp_path / "server.log",
                         runtime_env(SGLANG_HS_DUMP_DIR=str(tmp_path / "dump"), **env),
                         [*extra_args, "--forward-hooks", hooks])


def random_prompts(lengths: Sequence[int], seed: int) -> List[List[int]]:
    """Prompts of the given lengths with distinct first tokens: no two are equal, and one
    is told from another by its first row alone."""
    rng = random.Random(seed)
    first_tokens = rng.sample(range(FIRST_PROMPT_TOKEN, VOCAB_SIZE), len(lengths))
    return [[first] + [rng.randrange(FIRST_PROMPT_TOKEN, VOCAB_SIZE) for _ in range(length - 1)]
            for first, length in zip(first_tokens, lengths)]


def generate_body(prompt: Sequence[int], rid: str, max_new_tokens: int) -> dict:
    return {
        "rid": rid, "input_ids": list(prompt),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
                            "logit_bias": {str(OUTPUT_TOKEN): 100.0}},
    }


def post_all(server, bodies: Sequence[dict], workers: int = 64, path: str = "/generate") -> List[dict]:
    """Send every body at once from a thread pool; the responses, in order."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda body: server.post(path, body), bodies))


def relative_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per row: |actual - expected| / |expected|."""
    actual, expected = actual.float(), expected.float()
    return (actual - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-6)


def assert_matches_oracle(record: DumpRecord, prompt: Sequence[int], streams: Dict[str, torch.Tensor], what: str):
    """The file holds the prompt, and every row of every layer equals the oracle's."""
    assert record.token_ids.tolist() == list(prompt), f"{what}: token ids differ from the prompt"
    num_tokens = len(prompt)
    assert record.hidden_states.shape[0] == num_tokens and record.last_hidden_state.shape[0] == num_tokens, what
    for k, layer_id in enumerate(record.layer_ids):
        errors = relative_errors(record.hidden_states[:, k], streams[str(layer_id)])
        worst = int(errors.argmax())
        assert errors[worst] <= ROW_TOLERANCE, (
            f"{what}: layer {layer_id} row {worst} of {num_tokens}: relative error {errors[worst]:.3g}")
    errors = relative_errors(record.last_hidden_state, streams["last"])
    worst = int(errors.argmax())
    assert errors[worst] <= ROW_TOLERANCE, (
        f"{what}: last_hidden_state row {worst} of {num_tokens}: relative error {errors[worst]:.3g}")


def dump_stats(log: str) -> Optional[Dict[str, int]]:
    """The dump's counters from the last counters line of a server log (None: none logged)."""
    counters = DumpCounters.parse(log)
    return None if counters is None else asdict(counters)


def wait_until(condition, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).norm() / expected.norm()).item()


def run_one_prefill(model: Path, tmp_path: Path, num_layers: int, layers_env, prompt_len: int,
                    extra_args: Sequence[str] = (), decoder: str = "model", **env):
    layers = {} if layers_env is None else {"SGLANG_HS_DUMP_LAYERS": layers_env}
    prompt = random.Random(prompt_len).sample(range(5, 1000), prompt_len)
    server = OracleServer(model, tmp_path, num_layers, extra_args, decoder, **layers, **env)
    dump_dir, oracle_dir = server.dump_dir, server.oracle_dir
    with server:
        server.wait_ready()
        assert not (dump_dir / "manifest.jsonl").exists(), "the server's warmup request was dumped"
        answer = server.generate(prompt, max_new_tokens=2)
        manifest = wait_for_manifest(dump_dir, 1)
    # The response names the file its manifest line lists (meta_info's one entry).
    [reported] = answer["meta_info"][META_INFO_KEY]
    assert reported["sink"] == "files" and reported["file"] == manifest[0]["file"], (reported, manifest)
    return prompt, dump_dir, manifest, oracle_hooks.residual_streams(oracle_dir, num_layers, prompt_len)


# The exports' dump: prompts of these lengths, dumped in an order of our own with L (the
# SpecForge export takes those below L in ascending order, the order SGLang feeds a draft,
# ids 0 and 2 being ones every release here can feed; speculators takes L last).
EXPORT_PROMPT_LENGTHS = [1, 17, 64, 130, 257]
EXPORT_DUMP_LAYERS = [2, 0, 3]


def dump_export_prompts(model: Path, dump_dir: Path, **env) -> Path:
    """The exports' prompts dumped by a server on `model` (rids export-0, export-1, ...),
    one at a time in order, so that two servers given them dump the same values."""
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(dump_dir), SGLANG_HS_DUMP_LAYERS=",".join(map(str, EXPORT_DUMP_LAYERS)),
                      **env)
    with Server(model, dump_dir.with_name(dump_dir.name + "-server.log"), env) as server:
        server.wait_ready()
        for i, prompt in enumerate(random_prompts(EXPORT_PROMPT_LENGTHS, seed=21)):
            server.post("/generate", generate_body(prompt, f"export-{i}", 2))
        wait_for_manifest(dump_dir, len(EXPORT_PROMPT_LENGTHS))
    return dump_dir

