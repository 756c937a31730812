"""Benchmarks of the hidden-states dump against its alternatives, each comparison in one run.

    python -m scripts.bench.dump --suite prefill|hidden|write|scaling|fp8|profile|trace|sample|answers|regenerate [--preset cpu|gpu|gpu-rank|gpu-traffic] --out FILE.json

Suites (BENCHMARKS.md has the tables and the commands that produced them):
- prefill: prompt tokens/s of unpatched upstream, patched with dumping off, patched with
  dumping on (and, where the preset names a tmpfs, dumping to memory, which leaves the
  disk out); the servers run at once and rounds alternate between them. A dumping
  server's round ends when the last file of the round is in the manifest. Where the preset
  names tmpfs_stages, the tmpfs dump also runs with its later stages left out
  (scripts/bench/dump_stages.py); such a server lands no file and its round ends at its
  last response. Where the preset names store_consumers, the same rows also go into a
  Mooncake store on this machine (SGLANG_HS_DUMP_SINK=mooncake, SpecForge's layout, TCP; the
  control directory on the tmpfs) with a consumer per contender taking each sample out again
  (scripts/bench/local_store.py): its round ends when the manifest names every sample, then
  waits, untimed, until the consumer has acknowledged them all.
- hidden: hidden-state tokens/s delivered by the dump (to disk) vs SGLang's own
  `return_hidden_states` over HTTP on the same server vs transformers' `output_hidden_states`.
- write: the dump's write bandwidth vs `dd` to the same filesystem, and server RSS with
  dumping on vs off.
- scaling: dump cost vs prompt length and vs number of captured layers.
- fp8: fp8 storage against the bf16 dump of the same prompts (every layer): per-layer
  relative error of each token's row, the floor of two bf16 dumps, and the bytes.
- profile: the prefill workload on one dumping server run under py-spy: where the
  scheduler's and the writer threads' CPU time goes (scripts/bench/profile.py); with
  PY_SPY_GIL=1, where the time holding the interpreter lock goes.
- trace: one round of the prefill workload on dump off and each --contenders match under
  SGLang's torch profiler: the GPU's timeline per stream, the forward stream's idle gaps and
  what resumed each, and the host threads' CUDA runtime calls (scripts/bench/trace.py).
- sample: a serving load on dumping off, dumping on with none sampled, 1% of requests sampled
  and every request dumped (with `--contenders answers`: 1% sampled with their answers, the
  decode steps that carry one eager or replayed by graphs):
  throughput and the latency of the requests not dumped (scripts/bench/sampled_traffic.py).
- answers: one pass (an answer captured as it is decoded) against two (generated undumped,
  then prefilled with the dump on), on one server, with the rows of each compared
  (scripts/bench/answer_passes.py).
- regenerate: the generate command on one chat dataset, plainly and with --regenerate, each on
  its own server (scripts/bench/regenerate.py).

Every dumping server logs its dump timings as it exits (DumpTimings: scheduler time taking
rows and blocked on a full queue, writer time waiting for copies, writing, and taking its
turn in the manifest); the prefill and profile suites report them as shares of the measured time.

Ratios are reported with min/median/max over the repeats. Results are saved after every
round; `--deadline-s` stops starting rounds (at least one runs) when time is short.
Nothing here asserts timings.
"""

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from scripts.bench.local_store import LocalStore
from scripts.bench.measure import (clear_files, dd_rate, directory_bytes, filesystem, prompts_for, send_all,
                                   send_and_land, send_and_land_split, summary)
from scripts.bench.copier_hooks import copier_hook, slices_hook
from scripts.bench.dump_stages import STAGE_ENV, forward_hooks_arg
from scripts.bench.profile import read_stacks, summarize
from scripts.bench.trace import summarize_trace
from scripts.bench.run import SERVER_ARGS, BenchRun, rss_parts_kib, total_rss_kib
from scripts.bench.answer_passes import suite_answers
from scripts.bench.regenerate import suite_regenerate
from scripts.bench.sampled_traffic import suite_sample
from scripts.dumps.server import Server, child_pids, has_gpu
from scripts.dumps.tiny_model import ensure_model

# The Mooncake sink's contenders, by how their consumer takes samples out of the store
# (scripts/bench/store_consumer.py): acknowledged unread (the store's own cost), or read by a
# trainer's loop on this machine, then acknowledged.
STORE_CONSUMERS = {"acknowledged unread": "ack", "read and acknowledged": "read"}
# The sink's settings for those contenders: bf16 rows (the model's dtype) in SpecForge's layout.
STORE_SINK_ENV = {"SGLANG_HS_DUMP_SINK": "mooncake", "SGLANG_HS_DUMP_SINK_LAYOUT": "specforge"}

PRESETS = {
    # 2 CPU cores: small enough to finish in minutes.
    "cpu": dict(model=dict(layers=4), prompts=16, prompt_len=256, repeats=3, server_args=SERVER_ARGS,
                lengths=(128, 512, 2048), layer_counts=(1, 4), hidden_prompts=8, fidelity_prompts=4,
                store_consumers=STORE_CONSUMERS, store_segment_size=1 << 30,
                traffic=dict(requests=256, in_flight=32, prompt_len=128, max_new_tokens=16),
                answers=dict(requests=32, in_flight=16, prompt_len=256, max_new_tokens=64),
                regenerate=dict(conversations=32, concurrency=16, max_new_tokens=64)),
    # The sample suite on a GPU: the tiny model, so a step's time is the scheduler's own work (the
    # Python of every forward, where a capture's cost would show first), decode CUDA graphs on as
    # served. Four servers share the GPU; --max-total-tokens, not the fraction, sizes each KV cache.
    # DeepSeek's attention widths: at the cpu widths the triton MLA decode kernel does not compile
    # on an H100 (its tl.dot meets head widths of 64 and 128).
    "gpu-traffic": dict(model=dict(layers=4, widths="deepseek"), prompts=16, prompt_len=256, repeats=5,
                        server_args=SERVER_ARGS + ("--mem-fraction-static", "0.15", "--max-total-tokens", "131072"),
                        traffic=dict(requests=1024, in_flight=128, prompt_len=128, max_new_tokens=32),
                        answers=dict(requests=256, in_flight=64, prompt_len=512, max_new_tokens=256),
                        regenerate=dict(conversations=256, concurrency=64, max_new_tokens=256)),
    # DeepSeek-V3's hidden size with few layers and experts, so prefill is compute-bound.
    # Up to five servers share the GPU. Prefill batches of 256 x 512 tokens exceed the
    # prefill CUDA graphs' token limit, so graphs would only serve warmup; off, servers
    # start in a third of the time.
    # Up to seven servers share the GPU. Each prefill contender also dumps to the tmpfs with
    # one setting changed (tmpfs_variants): the levers measured one at a time. Servers
    # starting at once see each other's allocations as their own weights' while they load,
    # so the static fraction leaves room for that; --max-total-tokens, not the fraction,
    # sizes each KV cache (1.2 GB).
    "gpu": dict(model=dict(layers=4, widths="deepseek", hidden_size=7168), prompts=512, prompt_len=512,
                repeats=12, server_args=SERVER_ARGS + ("--mem-fraction-static", "0.25", "--max-total-tokens", "262144",
                                                          "--disable-cuda-graph"),
                lengths=(128, 512, 2048, 8192), layer_counts=(1, 4), hidden_prompts=64, fidelity_prompts=16,
                tmpfs_dir="/dev/shm",
                tmpfs_variants={"fp8": {"SGLANG_HS_DUMP_DTYPE": "fp8"},
                                "1 layer": {"SGLANG_HS_DUMP_LAYERS": "3"},
                                "8 writer threads": {"SGLANG_HS_DUMP_WRITER_THREADS": "8"},
                                "16 writer threads": {"SGLANG_HS_DUMP_WRITER_THREADS": "16"},
                                "writer threads": {"SGLANG_HS_DUMP_WRITER_PROCESS": "0"}},
                tmpfs_copier_hooks={"fp8 quantized by PyTorch": ({"SGLANG_HS_DUMP_DTYPE": "fp8"}, "quantized_by_pytorch")},
                traffic=dict(requests=2048, in_flight=256, prompt_len=512, max_new_tokens=64)),
    # A TP8 rank's compute per token: one rank of DeepSeek-V3 / Kimi-K2.5 (61 layers, 58 of
    # them MoE with 8 of 256 experts active, TP8) does about 9 GFLOP per token; 16 layers at
    # DeepSeek width with this model's experts do about 6, so a prefill runs at the rate a
    # rank's does and the dump must land what a rank's writer lands. Its 12 GB of weights per
    # server fill the GPU's memory check when servers start together, so each starts once
    # the one before has loaded. The gpu preset above stays the stress case.
    "gpu-rank": dict(model=dict(layers=16, widths="deepseek", hidden_size=7168), prompts=256, prompt_len=512,
                     repeats=11, start_one_at_a_time=True,
                     server_args=SERVER_ARGS + ("--mem-fraction-static", "0.3", "--max-total-tokens", "262144",
                                                "--disable-cuda-graph"),
                     lengths=(512,), layer_counts=(1,), hidden_prompts=64, fidelity_prompts=16,
                     tmpfs_dir="/dev/shm", tmpfs_variants={"fp8": {"SGLANG_HS_DUMP_DTYPE": "fp8"},
                                                           "1 writer thread": {"SGLANG_HS_DUMP_WRITER_THREADS": "1"},
                                                           # The files written by threads of the
                                                           # scheduler's process, not a writer process.
                                                           "writer threads": {"SGLANG_HS_DUMP_WRITER_PROCESS": "0"}},
                     # The copier's slice size (16 MiB by default) against the lock hand-overs.
                     tmpfs_slices={"64 MiB slices": 64 << 20},
                     # fp8 quantized the way it was before fp8_rows' kernel.
                     tmpfs_copier_hooks={"fp8 quantized by PyTorch": ({"SGLANG_HS_DUMP_DTYPE": "fp8"},
                                                                      "quantized_by_pytorch")},
                     disk_variants={"fp8": {"SGLANG_HS_DUMP_DTYPE": "fp8"}},
                     # Where the time of a dump to memory goes (pick them with --contenders: at
                     # this preset four servers fit the GPU, a fifth fails SGLang's memory check).
                     tmpfs_stages={"capture skipped": "capture_skipped", "rows not copied": "rows_not_copied",
                                   "copied, not written": "copied_not_written",
                                   "fp8 quantized, not copied": "quantized_not_copied"},
                     # The store holds a round of 768 prompts (22.5 GB of bf16 rows) with room
                     # to spare; its consumers keep it near empty.
                     store_consumers=STORE_CONSUMERS, store_segment_size=32 << 30,
                     store_variants={"in the server's own memory": {"MOONCAKE_GLOBAL_SEGMENT_SIZE": "16GB"}},
                     traffic=dict(requests=2048, in_flight=256, prompt_len=512, max_new_tokens=64)),
}


def upstream_tree() -> Path:
    """The unpatched package tree: UPSTREAM_TREE, else the runtime's own site-packages."""
    if os.environ.get("UPSTREAM_TREE"):
        return Path(os.environ["UPSTREAM_TREE"])
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def tmpfs_holds_a_round(model, preset) -> bool:
    """Whether the preset's tmpfs has room for two rounds of dumps (4 states per token)."""
    if not preset.get("tmpfs_dir") or not Path(preset["tmpfs_dir"]).is_dir():
        return False
    hidden_size = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
    round_bytes = preset["prompts"] * preset["prompt_len"] * 4 * hidden_size * 2
    return shutil.disk_usage(preset["tmpfs_dir"]).free > 2 * round_bytes


@dataclass
class Contender:
    """One prefill contender: where it dumps (None: nowhere; a Mooncake sink's control
    directory), its environment, its extra server arguments, whether its round waits for its
    files (a server whose dump stages are left out lands none), and, for a Mooncake sink, how
    its consumer takes samples out of the store (a STORE_CONSUMERS mode)."""

    dump_dir: Optional[Path] = None
    env: Dict[str, str] = field(default_factory=dict)
    extra: Tuple[str, ...] = ()
    lands: bool = True
    store_consumer: Optional[str] = None


def start_contender(run: BenchRun, label: str, name: str, contender: Contender, store: LocalStore) -> Server:
    """Start the server of the contender called `name` (upstream runs the unpatched tree)."""
    env = dict(contender.env, **store.env(name))
    if contender.dump_dir:
        env["SGLANG_HS_DUMP_DIR"] = str(contender.dump_dir)
    return run.start_server(label, env, contender.extra, tree=upstream_tree() if name == "upstream" else None)


def prefill_contenders(run: BenchRun) -> Dict[str, Contender]:
    """Each prefill contender; run.contenders, when set, keeps the ones whose name it
    matches (and always dump off, which the ratios divide by)."""
    preset = run.preset
    contenders = {"upstream": Contender(lands=False), "patched, dump off": Contender(lands=False),
                  "patched, dump on": Contender(run.work / "dump-prefill")}
    for index, (label, env) in enumerate(preset.get("disk_variants", {}).items()):
        contenders[f"patched, dump on (disk, {label})"] = Contender(run.work / f"dump-prefill-{index}", env)
    if tmpfs_holds_a_round(run.model, preset):
        # Memory takes bytes faster than the disk: what is left is the server's own cost.
        variants = {"": {}, **{f", {label}": env for label, env in preset.get("tmpfs_variants", {}).items()}}
        for index, (label, env) in enumerate(variants.items()):
            dump_dir = Path(tempfile.mkdtemp(prefix=f"dump-prefill-{index}-", dir=preset["tmpfs_dir"]))
            contenders[f"patched, dump on (tmpfs{label})"] = Contender(dump_dir, env)
        # The same dump with the copier's rows crossing in slices of another size.
        for label, slice_bytes in preset.get("tmpfs_slices", {}).items():
            dump_dir = Path(tempfile.mkdtemp(prefix=f"dump-prefill-slices-{slice_bytes}-", dir=preset["tmpfs_dir"]))
            contenders[f"patched, dump on (tmpfs, {label})"] = Contender(
                dump_dir, extra=("--forward-hooks", json.dumps([slices_hook(slice_bytes)])))
        # The same dump with the copier changed (scripts/bench/copier_hooks.py).
        for label, (env, hook) in preset.get("tmpfs_copier_hooks", {}).items():
            dump_dir = Path(tempfile.mkdtemp(prefix=f"dump-prefill-{hook}-", dir=preset["tmpfs_dir"]))
            contenders[f"patched, dump on (tmpfs, {label})"] = Contender(
                dump_dir, env, extra=("--forward-hooks", json.dumps([copier_hook(hook)])))
        # The same dump with its later stages left out (scripts/bench/dump_stages.py).
        for label, stage in preset.get("tmpfs_stages", {}).items():
            dump_dir = Path(tempfile.mkdtemp(prefix=f"dump-prefill-{stage}-", dir=preset["tmpfs_dir"]))
            contenders[f"patched, dump on (tmpfs, {label})"] = Contender(
                dump_dir, STAGE_ENV.get(stage, {}), extra=("--forward-hooks", forward_hooks_arg(stage)), lands=False)
    # The same rows put into the run's Mooncake store; the control directory, which holds only
    # manifests, SpecForge's refs and the consumer's acknowledgements, where the tmpfs dumps go.
    for label, consumer in preset.get("store_consumers", {}).items():
        control_dir = Path(tempfile.mkdtemp(prefix=f"store-control-{consumer}-", dir=preset.get("tmpfs_dir", run.work)))
        contenders[f"patched, dump on (store, {label})"] = Contender(control_dir, STORE_SINK_ENV,
                                                                     store_consumer=consumer)
    # The same into memory the server's writer lends the store, which then holds the samples
    # that writer puts (a copy on its host, not a transfer); acknowledged unread.
    for index, (label, env) in enumerate(preset.get("store_variants", {}).items()):
        control_dir = Path(tempfile.mkdtemp(prefix=f"store-control-variant-{index}-",
                                            dir=preset.get("tmpfs_dir", run.work)))
        contenders[f"patched, dump on (store, {label}, acknowledged unread)"] = Contender(
            control_dir, {**STORE_SINK_ENV, **env}, store_consumer="ack")
    if run.contenders:
        contenders = {name: contender for name, contender in contenders.items()
                      if name == "patched, dump off" or re.search(run.contenders, name)}
    return contenders


def local_store(run: BenchRun, contenders: Dict[str, Contender]) -> LocalStore:
    """The run's Mooncake store and consumers, for the contenders that put into one."""
    return LocalStore(run.work, run.preset.get("store_segment_size", 0),
                      {name: (contender.dump_dir, contender.store_consumer)
                       for name, contender in contenders.items() if contender.store_consumer})


def stop_all(servers) -> None:
    """Stop servers side by side: each can take half a minute to exit (0.5.14's launcher
    treats its terminated detokenizer as a crash, then waits)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(Server.stop, servers))


def dump_profile(server: Server, seconds: float) -> Optional[dict]:
    """Where a dumping server's dump time went (its timings line at exit), as shares of
    the `seconds` it was measured for; writer shares are per writer thread."""
    from scripts.dump_format import DumpCounters, DumpTimings

    log = server.log()
    timings, counters = DumpTimings.parse(log), DumpCounters.parse(log)
    threads = re.findall(r"writer_threads=(\d+)", log)
    if timings is None or counters is None or not threads:
        return None
    writer_seconds = seconds * int(threads[-1])
    return {"timings_ms": asdict(timings), "counters": asdict(counters), "writer_threads": int(threads[-1]),
            "measured_s": round(seconds, 2),
            "scheduler_share": {"capture": timings.capture_ms / 1000 / seconds,
                                "blocked_on_full_queue": timings.blocked_ms / 1000 / seconds},
            "writer_share": {"waiting_for_copies": timings.copy_wait_ms / 1000 / writer_seconds,
                             "writing": timings.write_ms / 1000 / writer_seconds,
                             "manifest_turn_rename_and_line": timings.manifest_ms / 1000 / writer_seconds}}


def suite_prefill(run: BenchRun) -> dict:
    preset = run.preset
    contenders = prefill_contenders(run)
    # The dump directories whose files a round waits for.
    dumps = {name: contender.dump_dir if contender.lands else None for name, contender in contenders.items()}
    store = local_store(run, contenders)
    tokens = preset["prompts"] * preset["prompt_len"]
    names = list(contenders)
    seconds = {name: [] for name in names}
    responded = {name: [] for name in names}  # seconds to the round's last response
    measured = {name: 0.0 for name in names}  # every timed send, warm-up included
    # Bytes of each round's rows: a file sink's files, a store sink's samples in the store.
    landed = {name: [] for name in names if dumps[name]}
    on_disk = {name: [] for name in names if dumps[name]}  # what each round added to the dump directory
    drain_waits = {name: [] for name in store.consumers}  # seconds from a round's last sample to its last ack

    def result(rss=None, profiles=None, consumers_at_exit=None) -> dict:
        rounds = min(len(values) for values in seconds.values())
        per_round = {name: values[:rounds] for name, values in seconds.items()}
        off = per_round["patched, dump off"]
        ratios = {}
        if "upstream" in per_round:
            ratios["patched off / upstream"] = [u / o for u, o in zip(per_round["upstream"], off)]
        for name in (name for name in names if contenders[name].dump_dir):
            ratios[f"{name.replace('patched, ', '')} / dump off"] = [o / d for o, d in zip(off, per_round[name])]
        return {"prompt_tokens_per_s": {name: summary([tokens / s for s in values]) for name, values in per_round.items()},
                "throughput_ratio": {name: summary(values) for name, values in ratios.items()},
                "landed_bytes_per_s": {name: summary([b / s for b, s in zip(landed[name], per_round[name])])
                                       for name in landed if landed[name][:rounds]},
                "disk_bytes_per_round": {name: summary(values[:rounds]) for name, values in on_disk.items() if values[:rounds]},
                # A store sink's rows over the seconds from the round's start until its consumer
                # had acknowledged every sample: the rate the store was emptied at.
                "store_drained_bytes_per_s": {name: summary([b / (s + w) for b, s, w in
                                                             zip(landed[name], per_round[name], waits)])
                                              for name, waits in drain_waits.items() if waits[:rounds]},
                "store_drain_wait_s": {name: summary(waits[:rounds]) for name, waits in drain_waits.items() if waits[:rounds]},
                "store": {"segment_bytes": store.segment_size, "layout": STORE_SINK_ENV["SGLANG_HS_DUMP_SINK_LAYOUT"],
                          "consumers": {name: mode for name, (_, mode) in store.consumers.items()},
                          "consumers_at_exit": consumers_at_exit} if store.consumers else None,
                # What a sustained load would see: the round without the last forward's files.
                "prompt_tokens_per_s_to_last_response": {name: summary([tokens / s for s in values[:rounds]])
                                                         for name, values in responded.items() if contenders[name].dump_dir},
                "rounds": rounds, "server_rss_kib": rss, "dump_profile": profiles,
                "contenders_started": "one after another" if preset.get("start_one_at_a_time") else "at once",
                "workload": f"{preset['prompts']} prompts x {preset['prompt_len']} tokens, 1 output token; "
                            f"dump files removed after each round, a store's samples by its consumer"}

    servers = {}
    try:
        store.start()
        for index, (name, contender) in enumerate(contenders.items()):
            servers[name] = start_contender(run, f"prefill-{index}", name, contender, store)
            if preset.get("start_one_at_a_time"):
                # Past its memory check (which counts what others take meanwhile as its own);
                # the warmups, which compile kernels for a minute, overlap.
                servers[name].wait_listening()
                run.progress(f"prefill: {name} loaded")
        for server in servers.values():
            server.wait_ready()
        run.progress(f"prefill: {len(servers)} servers ready")
        for name in names:  # one round each not in the results: compile caches, allocator warm-up
            measured[name] += send_and_land(servers[name], prompts_for(8, preset["prompt_len"], seed=99), dumps[name])
            if name in store.consumers:
                store.round_drained(name)
            clear_files(dumps[name])
        for round_index in run.rounds():
            # New prompts every round: a repeated prompt would hit the prefix cache of the
            # servers that do not dump and compare a cache hit with a full prefill.
            prompts = prompts_for(preset["prompts"], preset["prompt_len"], seed=1000 + round_index)
            order = names[round_index % len(names):] + names[: round_index % len(names)]
            for name in order:
                disk_before = directory_bytes(dumps[name]) if dumps[name] else 0
                to_response, to_land = send_and_land_split(servers[name], prompts, dumps[name])
                seconds[name].append(to_land)
                responded[name].append(to_response)
                measured[name] += to_land
                if name in store.consumers:
                    published, drain_wait = store.round_drained(name)
                    landed[name].append(published)
                    drain_waits[name].append(drain_wait)
                elif dumps[name]:
                    landed[name].append(sum(p.stat().st_size for p in dumps[name].glob("*.safetensors")))
                if dumps[name]:
                    on_disk[name].append(directory_bytes(dumps[name]) - disk_before)
                clear_files(dumps[name])
            run.checkpoint(result())
            run.progress(f"prefill: round {round_index + 1}: " + ", ".join(f"{n} {s[-1]:.2f}s" for n, s in seconds.items()))
        rss = {name: rss_parts_kib(server) for name, server in servers.items()}
    finally:
        stop_all(servers.values())  # a dumping server logs its timings as it exits
        consumers_at_exit = store.stop()
    return result(rss, {name: dump_profile(servers[name], measured[name])
                        for name in names if contenders[name].dump_dir}, consumers_at_exit)


def suite_hidden(run: BenchRun) -> dict:
    preset, work = run.preset, run.work
    dump_dir = work / "dump-hidden"
    env = {"SGLANG_HS_DUMP_DIR": str(dump_dir), "SGLANG_HS_DUMP_LAYERS": "3"}
    tokens = preset["hidden_prompts"] * preset["prompt_len"]
    server = run.start_server("hidden", env, ["--enable-return-hidden-states"])
    dump_rates, http_rates = [], []
    try:
        server.wait_ready()
        send_and_land(server, prompts_for(4, preset["prompt_len"], seed=98), dump_dir)
        for round_index in run.rounds():
            prompts = prompts_for(preset["hidden_prompts"], preset["prompt_len"], seed=2000 + round_index)
            dump_rates.append(tokens / send_and_land(server, prompts, dump_dir))
            clear_files(dump_dir)
            started = time.perf_counter()
            send_all(server, prompts_for(len(prompts), preset["prompt_len"], seed=3000 + round_index),
                     return_hidden_states=True)
            http_rates.append(tokens / (time.perf_counter() - started))
    finally:
        server.stop()
    hf_rates = transformers_rates(run.model, prompts, preset["repeats"])
    workload = f"{preset['hidden_prompts']} prompts x {preset['prompt_len']} tokens"
    return {
        "hidden_tokens_per_s": {"dump (1 layer, to disk)": summary(dump_rates),
                                "return_hidden_states (HTTP)": summary(http_rates),
                                "transformers output_hidden_states": summary(hf_rates)},
        "ratio": {"dump / return_hidden_states": summary([d / h for d, h in zip(dump_rates, http_rates)]),
                  "dump / transformers": summary([d / h for d, h in zip(dump_rates, hf_rates)])},
        "workload": workload,
    }


def transformers_rates(model, prompts, repeats) -> List[float]:
    """Hidden-state tokens/s of transformers' forward with output_hidden_states, batches of 8."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if has_gpu() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device).eval()
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        with torch.no_grad():
            for i in range(0, len(prompts), 8):
                batch = torch.tensor(prompts[i : i + 8], device=device)
                states = hf.model(batch, output_hidden_states=True).hidden_states[3]
                states.to("cpu")
        rates.append(len(prompts) * len(prompts[0]) / (time.perf_counter() - started))
    del hf
    return rates


def suite_write(run: BenchRun) -> dict:
    preset, work = run.preset, run.work
    dump_dir = work / "dump-write"
    dump_dir.mkdir()
    size_mb = 512 if has_gpu() else 128
    dd_rates = [dd_rate(dump_dir, size_mb) for _ in range(preset["repeats"])]
    servers = {"dump on": run.start_server("write-on", {"SGLANG_HS_DUMP_DIR": str(dump_dir)}),
               "dump off": run.start_server("write-off", {})}
    dump_rates, rss = [], {}
    try:
        for server in servers.values():
            server.wait_ready()
        for round_index in run.rounds():
            prompts = prompts_for(preset["prompts"], preset["prompt_len"], seed=4000 + round_index)
            seconds = send_and_land(servers["dump on"], prompts, dump_dir)
            written = sum(p.stat().st_size for p in dump_dir.glob("*.safetensors"))
            dump_rates.append(written / seconds)
            clear_files(dump_dir)
            send_all(servers["dump off"], prompts)
        rss = {name: total_rss_kib(server) for name, server in servers.items()}
    finally:
        stop_all(servers.values())
    return {"bytes_per_s": {"dump": summary(dump_rates), "dd conv=fsync": summary(dd_rates)},
            "ratio": {"dump / dd": summary([d / r for d, r in zip(dump_rates, dd_rates)])},
            "server_rss_kib_after": rss, "filesystem": filesystem(dump_dir),
            "workload": f"{preset['prompts']} prompts x {preset['prompt_len']} tokens per round, default layers"}


def suite_scaling(run: BenchRun) -> dict:
    """Time with dumping on over time with it off, for the same prompts, alternating."""
    preset, work = run.preset, run.work
    results = {"by_prompt_len": {}, "by_layer_count": {}}
    base = run.start_server("scaling-off", {})
    try:
        base.wait_ready()
        dump_dir = work / "dump-scaling"
        dumping = run.start_server("scaling-on", {"SGLANG_HS_DUMP_DIR": str(dump_dir)})
        try:
            dumping.wait_ready()
            for length in preset["lengths"]:
                results["by_prompt_len"][length] = _time_ratio(run, base, dumping, dump_dir, length)
                run.checkpoint(results)
        finally:
            dumping.stop()
        for count in preset["layer_counts"]:
            dump_dir = work / f"dump-layers{count}"
            env = {"SGLANG_HS_DUMP_DIR": str(dump_dir),
                   "SGLANG_HS_DUMP_LAYERS": ",".join(str(i) for i in range(1, count + 1))}
            dumping = run.start_server(f"layers{count}", env)
            try:
                dumping.wait_ready()
                results["by_layer_count"][count] = _time_ratio(run, base, dumping, dump_dir, preset["prompt_len"])
                run.checkpoint(results)
            finally:
                dumping.stop()
    finally:
        base.stop()
    return results


def _time_ratio(run: BenchRun, base: Server, dumping: Server, dump_dir: Path, length: int) -> dict:
    preset = run.preset
    count = max(4, preset["prompts"] * preset["prompt_len"] // length // 4)
    warm_up = prompts_for(2, length, seed=length)
    send_all(base, warm_up)
    send_and_land(dumping, warm_up, dump_dir)
    on, off = [], []
    for round_index in run.rounds():
        prompts = prompts_for(count, length, seed=length * 100 + round_index)
        off.append(send_all(base, prompts))
        on.append(send_and_land(dumping, prompts, dump_dir))
        clear_files(dump_dir)
    return {"prompts": count, "tokens": count * length, "ratio_on_over_off_time": summary([a / b for a, b in zip(on, off)])}


def suite_fp8(run: BenchRun) -> dict:
    """fp8 storage against the bf16 dump of the same prompts on the same model: the relative
    error of each token's row, per captured layer (every layer of the model), and the bytes.
    A second bf16 dump of the same prompts gives the floor: two forwards of one prompt need
    not agree to the bit (other batches, other kernels)."""
    import torch
    from scripts.dump_format import dequantize_rows, load_dump, read_manifest

    preset = run.preset
    num_layers = json.loads((run.model / "config.json").read_text())["num_hidden_layers"]
    layers = list(range(1, num_layers + 1))
    dirs = {encoding: run.work / f"dump-{encoding}" for encoding in ("bf16", "fp8")}
    servers = {encoding: run.start_server(f"fp8-{encoding}", {"SGLANG_HS_DUMP_DIR": str(dump_dir),
                                                              "SGLANG_HS_DUMP_DTYPE": encoding,
                                                              "SGLANG_HS_DUMP_LAYERS": ",".join(map(str, layers))})
               for encoding, dump_dir in dirs.items()}
    prompts = prompts_for(preset["fidelity_prompts"], preset["prompt_len"], seed=6000)
    try:
        for server in servers.values():
            server.wait_ready()
        for encoding, server in servers.items():
            send_and_land(server, prompts, dirs[encoding])
        send_and_land(servers["bf16"], prompts, dirs["bf16"])  # the floor's second dump
    finally:
        stop_all(servers.values())

    def states(encoding) -> Dict[Tuple[int, ...], List[dict]]:
        """Per prompt (its token ids), each of its dumps as float32 [T, K + 1, H]."""
        by_prompt = {}
        for line in read_manifest(str(dirs[encoding])):
            record = load_dump(str(dirs[encoding] / line["file"]), raw=True)
            hidden, last = record.hidden_states, record.last_hidden_state
            if record.hidden_states_scale is not None:
                hidden = dequantize_rows(hidden, record.hidden_states_scale, torch.float32)
                last = dequantize_rows(last, record.last_hidden_state_scale, torch.float32)
            rows = torch.cat([hidden.float(), last.float().unsqueeze(1)], dim=1)
            by_prompt.setdefault(tuple(record.token_ids.tolist()), []).append(
                {"rows": rows, "bytes": (dirs[encoding] / line["file"]).stat().st_size})
        return by_prompt

    bf16, fp8 = states("bf16"), states("fp8")
    names = [f"layer {layer}" for layer in layers] + ["last_hidden_state"]

    def row_errors(pairs) -> Dict[str, dict]:
        errors = {name: [] for name in names}
        for reference, other in pairs:
            error = (other - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-12)
            for k, name in enumerate(names):
                errors[name] += error[:, k].tolist()
        return {name: {"median": statistics.median(values), "p99": sorted(values)[int(0.99 * (len(values) - 1))],
                       "max": max(values)} for name, values in errors.items()}

    prompts_seen = [key for key in bf16 if key in fp8 and len(bf16[key]) == 2]
    return {
        "prompts": len(prompts_seen), "prompt_len": preset["prompt_len"],
        "row_relative_error": {"fp8 / bf16": row_errors((bf16[k][0]["rows"], fp8[k][0]["rows"]) for k in prompts_seen),
                               "bf16 / bf16 (floor)": row_errors((bf16[k][0]["rows"], bf16[k][1]["rows"])
                                                                 for k in prompts_seen)},
        "file_bytes_ratio_fp8_over_bf16": sum(fp8[k][0]["bytes"] for k in prompts_seen)
        / sum(bf16[k][0]["bytes"] for k in prompts_seen),
    }


PY_SPY_RATE = 100  # samples per second


def stop_process_group(server: Server, timeout: float = 60) -> None:
    """Server.stop for a server whose launcher may have exited first: SIGTERM to the whole
    process group (a dumping scheduler drains and logs its timings), SIGKILL what is left."""
    group = server.process.pid
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            server.process.poll()
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
    server.process.poll()
    server.log_file.close()


def suite_profile(run: BenchRun) -> dict:
    """The prefill workload on one server dumping to the tmpfs (else the work dir), run under
    py-spy (PY_SPY=, else on PATH): where the scheduler's and the writer threads' CPU time goes."""
    py_spy = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not py_spy:
        return {"skipped": "py-spy not found (set PY_SPY= or put it on PATH)"}
    preset = run.preset
    on_tmpfs = tmpfs_holds_a_round(run.model, preset)
    dump_dir = Path(tempfile.mkdtemp(prefix="dump-profile-", dir=preset["tmpfs_dir"])) if on_tmpfs \
        else run.work / "dump-profile"
    raw = run.work / "py-spy-raw.txt"
    # py-spy starts the server, so it may read the server's memory without ptrace rights;
    # --nonblocking samples without pausing it.
    # PY_SPY_GIL=1: only samples of threads holding the interpreter lock, so each thread's
    # seconds are its time holding the lock the scheduler's event loop also needs.
    gil_only = os.environ.get("PY_SPY_GIL") == "1"
    launcher = [py_spy, "record", "--subprocesses", "--nonblocking", "--rate", str(PY_SPY_RATE),
                *(["--gil"] if gil_only else []), "--format", "raw", "-o", str(raw), "--"]
    server = run.start_server("profile", {"SGLANG_HS_DUMP_DIR": str(dump_dir)}, launcher=launcher)
    seconds = 0.0
    try:
        server.wait_ready()
        send_and_land(server, prompts_for(8, preset["prompt_len"], seed=99), dump_dir)
        for round_index in run.rounds():
            prompts = prompts_for(preset["prompts"], preset["prompt_len"], seed=5000 + round_index)
            seconds += send_and_land(server, prompts, dump_dir)
            clear_files(dump_dir)
        # The server's own shutdown (its scheduler drains and logs its timings); py-spy
        # writes its profile once the process it started is gone.
        for child in child_pids(server.process.pid):
            os.kill(child, signal.SIGTERM)
        try:
            server.process.wait(120)
        except subprocess.TimeoutExpired:
            pass
    finally:
        stop_process_group(server)
    if not raw.exists():
        return {"skipped": "py-spy wrote no profile", "log_tail": server.log()[-2000:]}
    return {"filesystem": filesystem(dump_dir), "dumping_rounds_s": round(seconds, 2), "gil_only": gil_only,
            "profile": summarize(read_stacks(raw), PY_SPY_RATE), "dump_profile": dump_profile(server, seconds)}


def suite_trace(run: BenchRun) -> dict:
    """One round of the prefill workload on dump off and each --contenders match, under the
    torch profiler (SGLang's /start_profile and /stop_profile around a round), servers started one
    after another: the GPU's timeline per stream and the host's CUDA runtime calls
    (scripts/bench/trace.py), to tell slower kernels from an idle forward stream."""
    preset = run.preset
    contenders = prefill_contenders(run)
    store = local_store(run, contenders)
    servers, results = {}, {}
    try:
        store.start()
        for index, (name, contender) in enumerate(contenders.items()):
            servers[name] = start_contender(run, f"trace-{index}", name, contender, store)
            servers[name].wait_listening()
        for index, (name, server) in enumerate(servers.items()):
            server.wait_ready()
            dump_dir = contenders[name].dump_dir if contenders[name].lands else None
            prompts = prompts_for(preset["prompts"], preset["prompt_len"], seed=7000)
            send_and_land(server, prompts_for(8, preset["prompt_len"], seed=99), dump_dir)
            plain = send_and_land(server, prompts, dump_dir)
            clear_files(dump_dir)
            trace_dir = run.work / f"trace-{index}"
            server.post_raw("/start_profile", {"output_dir": str(trace_dir), "activities": ["CPU", "GPU"]})
            profiled = send_and_land(server, prompts_for(preset["prompts"], preset["prompt_len"], seed=7001), dump_dir)
            server.post_raw("/stop_profile", {}, timeout=900)  # answers once the trace is written
            clear_files(dump_dir)
            traces = sorted(trace_dir.glob("*.trace.json*"))
            results[name] = {"round_s": round(plain, 3), "profiled_round_s": round(profiled, 3),
                             "trace": summarize_trace(traces[0]) if traces else None}
            run.checkpoint(results)
            run.progress(f"trace: {name}: round {plain:.2f}s, profiled {profiled:.2f}s")
    finally:
        stop_all(servers.values())
        store.stop()
    return results


SUITES = {"prefill": suite_prefill, "hidden": suite_hidden, "write": suite_write, "scaling": suite_scaling,
          "profile": suite_profile, "fp8": suite_fp8,
          "trace": suite_trace, "sample": suite_sample, "answers": suite_answers,
          "regenerate": suite_regenerate}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), action="append", required=True)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if has_gpu() else "cpu")
    parser.add_argument("--work-dir", type=Path, default=None, help="dump dirs and server logs (default: a temp dir)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contenders", default=None,
                        help="prefill and sample suites: keep the contenders whose name this regex matches (and dump off)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no new round this many seconds after the start (each comparison keeps one)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="prompts a round instead of the preset's (longer rounds: what a sustained load "
                             "sees, the tail after a round's last response paid once a round)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds instead of the preset's")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.prompts:
        preset = dict(preset, prompts=args.prompts)
    if args.repeats:
        preset = dict(preset, repeats=args.repeats)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-dump-"))
    work.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    run = BenchRun(preset, ensure_model(**preset["model"]), work, args.out, results, contenders=args.contenders)
    if args.deadline_s is not None:
        run.deadline = run.started + args.deadline_s
    run.progress(f"model ready: {run.model}")
    results["machine"] = {"host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                          "gpu": _gpu_name(), "preset": args.preset, "model": run.model.name}
    for name in args.suite:
        started = time.perf_counter()
        run.suite = name
        results[name] = SUITES[name](run)
        results[name]["suite_seconds"] = round(time.perf_counter() - started, 1)
        run.save()
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    return 0


def _gpu_name():
    if not has_gpu():
        return None
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    sys.exit(main())
