"""What a decode step that carries dumped answers costs the scheduler thread, rows staged on
the device or sent to the host every step.

    python -m scripts.bench.answer_steps [--device cuda] [--batch 128] [--dumped 2] --out FILE.json

The dump driven without a model or a server, as the model and the scheduler drive it: decode
steps of a batch of `--batch` requests, `--dumped` of which have their answers dumped, each
such request prefilled with a prompt of `--prompt-tokens`, then `--answer-tokens` decode steps,
then finished (finish_answer), and a new one takes its place. Per step, the time of the
scheduler thread's calls into the dump (capture, and finish_answer where a request finishes)
is taken, for two contenders in alternating rounds: `staged` (the dump as it is: the decode
rows staged on the device, staged_answers) and `every step` (a staging of no rows: each step's
rows gathered, given an event and handed to the copier, as before the staging). The copier's
and the writers' threads run as in a server, in this process; every sample is then checked
as written (files, no error). Needs the patched SGLang on PYTHONPATH.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from scripts.bench.measure import summary

CONTENDERS = ("staged", "every step")


def make_dumper(dump_dir: str, layers: int, num_layers: int, dtype: torch.dtype):
    from sglang.srt.hidden_states_dump.capture import HiddenStatesDumper
    from sglang.srt.hidden_states_dump.config import DumpConfig
    from sglang.srt.hidden_states_dump.format import file_metadata

    layer_ids = list(range(1, layers + 1))
    with mock.patch.dict(os.environ, {"SGLANG_HS_DUMP_DIR": dump_dir,
                                      "SGLANG_HS_DUMP_LAYERS": ",".join(map(str, layer_ids))}):
        config = DumpConfig.from_env()
    metadata = file_metadata(layer_ids, num_layers, "/models/bench", sglang_version="bench",
                             series_version="bench", fp8=False, model_dtype=dtype)
    return HiddenStatesDumper(config, metadata, is_writer=True, reserve_bytes=256 << 20)


class FinishedReq:
    """A scheduler Req as finish_answer reads it, hashed by identity as a Req is (the dump
    keeps where its sample is by it): its last token never fed back."""

    def __init__(self, rid, prompt, fed):
        self.rid, self.origin_input_ids, self.output_ids = rid, prompt, fed + [0]
        self.retraction_count, self.customized_info, self.send_token_offset = 0, None, 0
        self.finished_reason = SimpleNamespace(to_json=lambda: {"type": "length"})


def round_seconds(dumper, run, device, dtype, steps: int, first_rid: int):
    """One round: per step, the seconds of the dump's calls; and the samples it finished."""
    from sglang.srt.hidden_states_dump.requests import DumpRequest
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    hidden = run.hidden_size
    batch_rows = torch.randn(run.batch, hidden, device=device).to(dtype)
    aux_rows = [torch.randn(run.batch, hidden, device=device).to(dtype) for _ in range(run.layers)]
    slots = [i * run.batch // run.dumped for i in range(run.dumped)]  # the dumped requests' batch rows
    prompt = list(range(100, 100 + run.prompt_tokens))
    prompt_ids = torch.tensor(prompt, device=device)
    prompt_rows = torch.randn(run.prompt_tokens, hidden, device=device).to(dtype)
    prompt_aux = [prompt_rows.clone() for _ in range(run.layers)]
    live = {}  # per slot: its request's rid, the tokens fed so far, its answer's length
    next_rid = first_rid
    seconds, finished = [], 0

    def start(slot, answer_tokens):
        nonlocal next_rid
        rid = f"bench-{next_rid}"
        next_rid += 1
        forward_batch = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND, input_ids=prompt_ids,
            hidden_states_dump_requests=[DumpRequest(rid, len(prompt), answer=True)],
            extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[len(prompt)])
        dumper.capture(forward_batch, prompt_rows, prompt_aux)
        live[slot] = (rid, [], answer_tokens)

    for index, slot in enumerate(slots):
        # The first answers are of staggered lengths: the requests do not finish in one step.
        start(slot, run.answer_tokens - index * run.answer_tokens // run.dumped)
    for step in range(steps):
        requests = [None] * run.batch
        seq_lens = [1000] * run.batch
        token_ids = torch.zeros(run.batch, dtype=torch.int64)
        for slot in slots:
            rid, fed, _ = live[slot]
            requests[slot] = DumpRequest(rid, len(prompt), answer=True, decoding=True)
            seq_lens[slot] = len(prompt) + len(fed) + 1
            token_ids[slot] = 1000 + step % 5000
            fed.append(1000 + step % 5000)
        forward_batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, hidden_states_dump_requests=requests,
            seq_lens_cpu=torch.tensor(seq_lens), input_ids=token_ids.to(device, non_blocking=True))
        started = time.perf_counter()
        dumper.capture(forward_batch, batch_rows, aux_rows)
        done = [slot for slot in slots if len(live[slot][1]) >= live[slot][2]]
        for slot in done:
            rid, fed, _ = live[slot]
            dumper.finish_answer(FinishedReq(rid, prompt, fed))
        seconds.append(time.perf_counter() - started)
        for slot in done:
            finished += 1
            start(slot, run.answer_tokens)
    for rid, fed, _ in live.values():  # the round's last answers end here, shorter
        dumper.finish_answer(FinishedReq(rid, prompt, fed))
    return seconds, finished + len(live), next_rid


def wait_for_files(dumper, files: int, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        counters = vars(dumper.counters())
        if counters["files"] + counters["errors"] + counters["discarded"] >= files or time.monotonic() > deadline:
            return counters
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=128, help="requests a decode step")
    parser.add_argument("--dumped", type=int, default=2, help="of them, answers dumped")
    parser.add_argument("--hidden-size", type=int, default=7168)
    parser.add_argument("--layers", type=int, default=3, help="captured layers")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1000, help="decode steps a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds a contender, alternating")
    parser.add_argument("--out", required=True)
    run = parser.parse_args()
    from sglang.srt.hidden_states_dump.staged_answers import StagedAnswerRows

    dtype = torch.bfloat16 if run.device != "cpu" else torch.float32
    per_step = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as dump_dir:
        dumper = make_dumper(dump_dir, run.layers, run.layers + 2, dtype)
        rid, files = 0, 0
        for round_ in range(run.rounds):
            for name in CONTENDERS if round_ % 2 == 0 else reversed(CONTENDERS):
                dumper._staged = StagedAnswerRows() if name == "staged" else StagedAnswerRows(capacity=0)
                seconds, finished, rid = round_seconds(dumper, run, run.device, dtype, run.steps, rid)
                files += finished
                per_step[name].append(statistics.mean(seconds) * 1e6)
                print(f"round {round_} {name}: {per_step[name][-1]:.1f} us a step (mean), {finished} samples", flush=True)
        checked = wait_for_files(dumper, files)
    result = {
        "workload": (f"{run.batch} requests a decode step, {run.dumped} with answers dumped "
                     f"({run.prompt_tokens}-token prompts, {run.answer_tokens}-token answers), hidden "
                     f"{run.hidden_size}, {run.layers} layers, {run.steps} steps a round, on {run.device}"),
        "us_per_step": {name: summary(values) for name, values in per_step.items()},
        "every_step_over_staged": statistics.median(per_step["every step"]) / statistics.median(per_step["staged"]),
        "samples_finished": files,
        "counters": checked,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "us_per_step"}, indent=1))
    for name, values in per_step.items():
        print(f"{name}: {statistics.median(values):.1f} us a step (median of rounds)")
    Path(run.out).write_text(json.dumps(result, indent=1))
    if checked["files"] != files or checked["errors"] or checked["discarded"]:
        raise SystemExit(f"not every sample was written whole: {checked} of {files}")


if __name__ == "__main__":
    main()
