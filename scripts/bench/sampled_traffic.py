"""The sample suite: what dumping a sampled fraction of live traffic costs the requests it does
not dump. One serving load (prompts with answers of several tokens, many in flight) on a server
with dumping off, one with dumping on that dumps none (SGLANG_HS_DUMP_SAMPLE=0, and no request
asks), one that dumps 1% of its requests (SGLANG_HS_DUMP_SAMPLE=0.01) and one that dumps every
request, rounds alternating between them. Per contender: requests/s and output
tokens/s of a round (to its last response), and the latency of the requests the server did not
dump and of all its requests (median and p99 over the round); a dumping server's round then waits, untimed, until the
files of the requests it did dump have landed, so no round inherits another's backlog."""

import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from scripts.bench.measure import clear_files, prompts_for, summary, wait_for_lines
from scripts.dump_format import META_INFO_KEY, ManifestFollower
from scripts.dumps.server import Server

# The contenders: the environment each server adds to the dump directory (None: dumping off).
# "none sampled" dumps nothing (no request asks): what dumping being on costs by itself. The
# "answers at 1%" ones dump 1% of the requests with their answers (SGLANG_HS_DUMP_ANSWERS), the
# decode steps that carry one run eagerly or replayed by graphs (SGLANG_HS_DUMP_ANSWER_GRAPHS):
# what the requests batched beside a dumped answer pay; "answers at 0%, graphs" is the graphs'
# server dumping nothing: what their copy of every replay's rows costs by itself. The first four
# run unless --contenders names others.
ONE_PERCENT = {"SGLANG_HS_DUMP_SAMPLE": "0.01", "SGLANG_HS_DUMP_SAMPLE_SEED": "1"}
CONTENDERS = {"dump off": None, "none sampled": {"SGLANG_HS_DUMP_SAMPLE": "0"},
              "1% sampled": ONE_PERCENT,
              "every request": {},
              "answers at 1%, eager": {**ONE_PERCENT, "SGLANG_HS_DUMP_ANSWERS": "1"},
              "answers at 1%, graphs": {**ONE_PERCENT, "SGLANG_HS_DUMP_ANSWERS": "1",
                                        "SGLANG_HS_DUMP_ANSWER_GRAPHS": "1"},
              "answers at 0%, graphs": {"SGLANG_HS_DUMP_SAMPLE": "0", "SGLANG_HS_DUMP_ANSWERS": "1",
                                        "SGLANG_HS_DUMP_ANSWER_GRAPHS": "1"}}
DEFAULT_CONTENDERS = ("dump off", "none sampled", "1% sampled", "every request")


def send_traffic(server: Server, prompts: List[List[int]], rids: List[str], max_new_tokens: int,
                 in_flight: int) -> Tuple[float, List[Tuple[float, bool]]]:
    """Seconds to the last response, and per request its latency and whether the server dumped it."""

    def one(prompt, rid):
        started = time.perf_counter()
        answer = server.post("/generate", {"input_ids": prompt, "rid": rid,
                                           "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                               "ignore_eos": True}})
        dumped = bool((answer.get("meta_info", {}).get(META_INFO_KEY) or [None])[0])
        return time.perf_counter() - started, dumped

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        requests = list(pool.map(one, prompts, rids))
    return time.perf_counter() - started, requests


def stats(values: List[float]) -> Dict[str, float]:
    p99 = statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]
    return {"median": statistics.median(values), "p99": p99}


def suite_sample(run) -> dict:
    preset = run.preset
    traffic = preset["traffic"]
    # --contenders keeps the ones whose name it matches, beside dumping off.
    contenders = {name: env for name, env in CONTENDERS.items()
                  if env is None or (re.search(run.contenders, name) if run.contenders else name in DEFAULT_CONTENDERS)}
    names = list(contenders)
    dump_dirs: Dict[str, Optional[Path]] = {name: None if env is None else run.work / f"dump-sample-{index}"
                                            for index, (name, env) in enumerate(contenders.items())}
    round_s = {name: [] for name in names}
    # Latency median and p99 per round: of the requests not dumped ("every request" has none)
    # and of all requests.
    latency = {kind: {name: [] for name in names} for kind in ("not_dumped", "all")}
    dumped = {name: [] for name in names}

    def result() -> dict:
        rounds = min(len(values) for values in round_s.values())
        off = round_s["dump off"][:rounds]
        requests, tokens = traffic["requests"], traffic["requests"] * traffic["max_new_tokens"]
        return {"requests_per_s": {name: summary([requests / s for s in values[:rounds]]) for name, values in round_s.items()},
                "output_tokens_per_s": {name: summary([tokens / s for s in values[:rounds]]) for name, values in round_s.items()},
                "throughput_ratio": {f"{name} / dump off": summary([o / s for o, s in zip(off, round_s[name][:rounds])])
                                     for name in names if name != "dump off"},
                **{f"{kind}_latency_{stat}_s": {name: summary([r[stat] for r in values[:rounds]])
                                                  for name, values in by_name.items() if values}
                   for kind, by_name in latency.items() for stat in ("median", "p99")},
                "not_dumped_latency_median_ratio": {
                    f"{name} / dump off": summary([s["median"] / o["median"] for o, s in
                                                   zip(latency["not_dumped"]["dump off"][:rounds],
                                                       latency["not_dumped"][name][:rounds])])
                    for name in names if name != "dump off" and latency["not_dumped"][name]},
                "dumped_per_round": {name: values[:rounds] for name, values in dumped.items()},
                "rounds": rounds,
                "workload": f"{requests} requests a round, {traffic['in_flight']} in flight, prompts of "
                            f"{traffic['prompt_len']} tokens, {traffic['max_new_tokens']} output tokens each (ignore_eos)"}

    servers = {}
    try:
        for index, (name, env) in enumerate(contenders.items()):
            server_env = {} if env is None else dict(env, SGLANG_HS_DUMP_DIR=str(dump_dirs[name]))
            servers[name] = run.start_server(f"sample-{index}", server_env)
        for server in servers.values():
            server.wait_ready()
        run.progress(f"sample: {len(servers)} servers ready")
        for round_index in [-1, *run.rounds()]:  # round -1 warms up and is not kept
            prompts = prompts_for(traffic["requests"], traffic["prompt_len"], seed=2000 + round_index)
            order = names[round_index % len(names):] + names[: round_index % len(names)]
            for name in order:
                follower = ManifestFollower(str(dump_dirs[name])) if dump_dirs[name] else None
                before = len(follower.poll()) if follower else 0
                rids = [f"traffic-{round_index}-{i}" for i in range(len(prompts))]
                seconds, requests = send_traffic(servers[name], prompts, rids, traffic["max_new_tokens"],
                                                 traffic["in_flight"])
                if follower:
                    wait_for_lines(follower, before + sum(d for _, d in requests), time.perf_counter(), 600)
                    clear_files(dump_dirs[name])
                if round_index < 0:
                    continue
                not_dumped = [took for took, was_dumped in requests if not was_dumped]
                round_s[name].append(seconds)
                if not_dumped:
                    latency["not_dumped"][name].append(stats(not_dumped))
                latency["all"][name].append(stats([took for took, _ in requests]))
                dumped[name].append(len(requests) - len(not_dumped))
            if round_index >= 0:
                run.checkpoint(result())
                run.progress(f"sample: round {round_index + 1}: " + ", ".join(
                    f"{n} {s[-1]:.2f}s ({dumped[n][-1]} dumped)" for n, s in round_s.items()))
    finally:
        for server in servers.values():
            server.stop()
    return result()
