"""Acceptance as SGLang counts it: a draft served with `--speculative-algorithm EAGLE3` beside the
target, held-out prompts sent to it, and for each answer the server's own counters
(`meta_info`: `completion_tokens`, `spec_verify_ct`, `spec_num_correct_drafts`). The acceptance
length is the generated tokens per verify step, over all answers (sum of completion_tokens /
sum of spec_verify_ct); tokens per second are measured with one request at a time.
"""

import json
import statistics
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional

from scripts.dumps.server import Server, runtime_env

# A chain of 4 draft tokens a step (top-1): an acceptance length between 1 and 5.
SPECULATIVE_ARGS = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "4",
                    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5"]
SAMPLINGS = {"greedy": {"temperature": 0.0}, "temperature-0.7": {"temperature": 0.7, "top_p": 1.0}}
MAX_NEW_TOKENS = 128
CONCURRENCY = 32
SAMPLING_SEED = 20261204
# One answer of MAX_NEW_TOKENS takes about a second here, but the first answers sampled at a
# temperature on a fresh machine wait about 100 s (SGLang compiles for that path then; run d
# met its call's limit inside that wait). A server that gives none in this long has hung, and
# the step ends the contender rather than spend the rest of its call waiting.
ANSWER_TIMEOUT_S = 300


def serve_args(draft: Path, dummy_weights: bool) -> List[str]:
    args = [*SPECULATIVE_ARGS, "--speculative-draft-model-path", str(draft),
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--mem-fraction-static", "0.5", "--max-total-tokens", "131072", "--random-seed", str(SAMPLING_SEED),
            # Decode graphs up to the requests in flight; no prefill graphs (their capture is a
            # minute of every start, and acceptance is decided in decode).
            "--cuda-graph-max-bs", str(CONCURRENCY), "--disable-piecewise-cuda-graph"]
    if dummy_weights:
        args += ["--speculative-draft-load-format", "dummy"]
    return args


def _answer(server: Server, prompt: dict, sampling: dict) -> dict:
    body = {"input_ids": prompt["input_ids"],
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, **sampling}}
    try:
        answer = server.post("/generate", body, timeout=ANSWER_TIMEOUT_S)
    except (TimeoutError, urllib.error.URLError) as e:
        if not isinstance(getattr(e, "reason", e), TimeoutError):
            raise
        raise RuntimeError(f"prompt {prompt['id']} had no answer in {ANSWER_TIMEOUT_S} s under {sampling}: "
                           f"the server hung (its log: {server.log_path.name})") from e
    meta = answer["meta_info"]
    return {"id": prompt["id"], "completion_tokens": meta["completion_tokens"],
            "spec_verify_ct": meta.get("spec_verify_ct", 0),
            "spec_num_correct_drafts": meta.get("spec_num_correct_drafts")}


def acceptance(answers: List[dict]) -> Dict[str, float]:
    tokens = sum(a["completion_tokens"] for a in answers)
    verifies = sum(a["spec_verify_ct"] for a in answers)
    per_request = [a["completion_tokens"] / a["spec_verify_ct"] for a in answers if a["spec_verify_ct"]]
    return {
        "accept_length": tokens / verifies if verifies else None,
        "per_request_mean": statistics.fmean(per_request) if per_request else None,
        "per_request_stdev": statistics.stdev(per_request) if len(per_request) > 1 else None,
        "completion_tokens": tokens, "verify_steps": verifies, "requests": len(answers),
    }


def measure(target: Path, draft: Path, prompts: List[dict], log: Path, dummy_weights: bool = False,
            timed_requests: int = 8, on_sampling: Optional[Callable[[dict], None]] = None) -> dict:
    """Serve `target` with `draft`, send every prompt under each sampling (all at once), then
    `timed_requests` of them one at a time for tokens per second. `on_sampling` gets the
    result so far after each sampling, so that a step stopped at its limit keeps it."""
    started = time.monotonic()
    server = Server(target, log, runtime_env(), serve_args(draft, dummy_weights), defaults=[], cwd=None)
    result = {"draft": str(draft), "dummy_weights": dummy_weights, "speculative_args": SPECULATIVE_ARGS,
              "max_new_tokens": MAX_NEW_TOKENS, "samplings": {}}
    with server:
        server.wait_ready()
        result["ready_s"] = round(time.monotonic() - started, 1)
        for name, sampling in SAMPLINGS.items():
            with ThreadPoolExecutor(CONCURRENCY) as pool:
                answers = list(pool.map(lambda p: _answer(server, p, sampling), prompts))
            timed = []
            for prompt in prompts[:timed_requests]:
                began = time.monotonic()
                answer = _answer(server, prompt, sampling)
                timed.append((answer["completion_tokens"], time.monotonic() - began))
            result["samplings"][name] = dict(
                acceptance(answers), sampling=sampling,
                tokens_per_s_one_request=round(sum(t for t, _ in timed) / sum(s for _, s in timed), 1))
            print(json.dumps({"draft": draft.name, "sampling": name,
                              "accept_length": result["samplings"][name]["accept_length"]}), flush=True)
            if on_sampling is not None:
                on_sampling(result)
    return result
