"""What the CPU tensor-parallel tests share: how a server of several ranks is launched on the
CPU, the workload they serve, and checks that the whole process tree is gone.

SGLang runs tensor parallelism on the CPU over gloo process groups (0.5.14 and 0.5.23; 0.5.9's
CPU path wants a CUDA device for its NCCL wrapper and does not start). Each setting below was
needed for a server of eight ranks to reach ready on a two-core host without AMX:
- SGLANG_CPU_OMP_THREADS_BIND: one core list per rank (SGLang refuses more ranks than NUMA
  nodes without it); ranks share the cores, and where the CPU has no AMX the lists are only
  logged, not bound.
- OMP_NUM_THREADS=1: eight ranks of one thread each fill two cores; each rank's OpenMP team
  of two would put sixteen threads on them.
- SGLANG_NCCL_SO_PATH naming no library: with the CUDA torch's own libnccl found, SGLang
  builds an NCCL communicator for CPU ranks, and they die at init ("Expected a cuda device").
- GLOO_SOCKET_IFNAME=lo: the ranks talk over loopback.
- --nccl-port: the process group's rendezvous port, one of its own per server.
"""

import os
import random
import time
from pathlib import Path
from typing import Dict, List, Sequence

from scripts.dumps.server import free_port

# Per request, prompts of these lengths, with a chunked prefill of CHUNK tokens: under, at
# and over a chunk, and several chunks long.
CHUNK = 64
PROMPT_LENGTHS = [1, 17, 64, 65, 130, 200, 333]
# Requests that ask for their answer: (prompt length, new tokens); one row a token fed back.
ANSWERS = [(20, 2), (70, 9), (129, 40)]
FIRST_PROMPT_TOKEN = 100  # output tokens lie below: a decode row is never taken for a prompt row
VOCAB_SIZE = 1024


def tp_env(tp: int) -> Dict[str, str]:
    """The environment a server of `tp` ranks needs on the CPU (module docstring)."""
    cores = os.sched_getaffinity(0)
    bind = "|".join(str(sorted(cores)[rank % len(cores)]) for rank in range(tp))
    return {
        "SGLANG_CPU_OMP_THREADS_BIND": bind, "OMP_NUM_THREADS": "1",
        "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2", "GLOO_SOCKET_IFNAME": "lo",
    }


def tp_args(tp: int) -> List[str]:
    return ["--tp-size", str(tp), "--nccl-port", str(free_port())]


def body(prompt: Sequence[int], rid: str, max_new_tokens: int, output_token: int, **custom_params) -> dict:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
                "logit_bias": {str(output_token): 100.0}, "custom_params": custom_params}
    return {"rid": rid, "input_ids": list(prompt), "sampling_params": sampling}


# What a TP1 server is compared on: these prompts, one request at a time, the first a server
# serves after its warmup. SGLang's CPU prefill attention reads the KV pool rather than the
# keys and values it computes (upstream, FINDINGS), so a row depends on which slots its
# request got and what they held: two servers agree only where they served the same requests
# in the same order, and batches formed by timing do not. (prompt length, new tokens, answer?)
COMPARED = [(1, 2, False), (37, 2, False), (64, 2, False), (65, 2, False), (200, 2, False), (70, 9, True)]


def compared_requests(answer_param: str) -> List[dict]:
    rng = random.Random(37)
    bodies = []
    for i, (length, new_tokens, answer) in enumerate(COMPARED):
        prompt = [rng.randrange(FIRST_PROMPT_TOKEN, VOCAB_SIZE) for _ in range(length)]
        custom = {answer_param: True} if answer else {}
        bodies.append(body(prompt, f"compared-{length}", new_tokens, 10 + i, **custom))
    return bodies


def workload(answer_param: str) -> Dict[str, List[dict]]:
    """Two rounds of requests, sent one round after the other. The first: prompt-only dumps
    of PROMPT_LENGTHS and answers (ANSWERS). The second, once the first is cached: a prompt
    sharing its first 150 tokens with a first-round prompt, and a first-round prompt again
    whole (new rids): each must still be dumped whole, never from the cached prefix. Every
    request decodes a token of its own (a logit bias), and no two requests of one round share
    a prompt position's token by more than chance, so the oracle tells their rows apart."""
    rng = random.Random(51)
    lengths = PROMPT_LENGTHS + [length for length, _ in ANSWERS]
    firsts = rng.sample(range(FIRST_PROMPT_TOKEN, VOCAB_SIZE), len(lengths) + 1)
    prompts = [[first] + [rng.randrange(FIRST_PROMPT_TOKEN, VOCAB_SIZE) for _ in range(n - 1)]
               for first, n in zip(firsts, lengths)]
    outputs = iter(range(10, FIRST_PROMPT_TOKEN))
    first = [body(prompt, f"prompt-{len(prompt)}", 2, next(outputs)) for prompt in prompts[:len(PROMPT_LENGTHS)]]
    first += [body(prompt, f"answer-{len(prompt)}", new_tokens, next(outputs), **{answer_param: True})
              for prompt, (_, new_tokens) in zip(prompts[len(PROMPT_LENGTHS):], ANSWERS)]
    shared = prompts[PROMPT_LENGTHS.index(200)][:150] + [rng.randrange(FIRST_PROMPT_TOKEN, VOCAB_SIZE) for _ in range(50)]
    second = [body(shared, "shared-prefix-200", 2, next(outputs)),
              body(prompts[PROMPT_LENGTHS.index(333)], "repeat-333", 2, next(outputs))]
    return {"first": first, "second": second}


def group_members(pgid: int) -> List[int]:
    """The live processes of process group `pgid` (a server's launcher leads its group)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def wait_for_group_gone(server, timeout: float) -> None:
    """Return once no process of the server's group is left; fail after `timeout` seconds."""
    deadline = time.monotonic() + max(timeout, 1)
    while group_members(server.process.pid):
        assert time.monotonic() < deadline, f"processes still running: {group_members(server.process.pid)}"
        time.sleep(0.2)
