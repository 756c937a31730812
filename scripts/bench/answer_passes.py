"""The answers suite: one pass against two, on one dumping server (SGLANG_HS_DUMP_SAMPLE=0:
only the requests that ask are dumped), the same prompts every round, rounds alternating.

- one pass: each prompt generates its answer with its custom_params asking for the dump and
  for its answer (hidden_states_dump_answer): one sample of the prompt and the answer's tokens
  fed back, whose decode steps run eagerly where decode CUDA graphs would replay (with
  `--contenders graphs`, the server runs with SGLANG_HS_DUMP_ANSWER_GRAPHS=1: the graphs
  replay and serve the dump);
- two passes: each prompt generates its answer undumped, then the prompt and the answer but
  its last token are prefilled with the dump on (what dumping a conversation the target wrote
  costs without the one-pass capture).

Per round, the seconds from the first request to the last manifest line. Fidelity, per
captured layer and the final state, as relative errors over rows: the one-pass answer rows
(decode steps) against the two-pass rows of the same tokens (one prefill), beside what two
prefills of the same tokens differ by (the two-pass samples of two rounds, batched apart) and
the prompt rows of the two passes (both prefills); and, from a second launch of the same server
running a round of each way, what two launches differ by (two_launches: each way's samples
against the first launch's, every row). Last, the answer rows of up to 16 agreeing samples,
decode and prefill, against transformers in float32 on the same tokens, beside transformers'
own bf16 (against_transformers). On the CPU SGLang's DeepSeek prefill is wrong upstream, so
there decode and prefill rows differ by that bug, not by the capture; transformers shows which
is right."""

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import torch

from scripts.bench.measure import clear_files, prompts_for, summary, wait_for_lines
from scripts.bench.transformers_rows import transformers_rows
from scripts.dump_format import ANSWER_PARAM, DUMP_PARAM, ManifestFollower, load_dump

PASSES = ("one pass", "two passes")
REFERENCE_SAMPLES = 16  # samples whose answer rows are held against transformers


def generate(server, prompt: List[int], rid: str, max_new_tokens: int, custom_params: dict) -> List[int]:
    answer = server.post("/generate", {
        "rid": rid, "input_ids": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
                            "custom_params": custom_params}})
    return answer["output_ids"]


def one_pass(server, prompt, rid, max_new_tokens) -> List[int]:
    return generate(server, prompt, rid, max_new_tokens, {DUMP_PARAM: True, ANSWER_PARAM: True})


def two_passes(server, prompt, rid, max_new_tokens) -> List[int]:
    answer = generate(server, prompt, f"{rid}-answer", max_new_tokens, {DUMP_PARAM: False})
    generate(server, prompt + answer[:-1], rid, 1, {DUMP_PARAM: True})
    return answer


def run_round(server, follower: ManifestFollower, prompts, rids, max_new_tokens, in_flight, how) -> tuple:
    """Seconds to the last manifest line, and each prompt's answer."""
    follower.poll()
    before = len(follower.entries)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        answers = list(pool.map(lambda p, r: how(server, p, r, max_new_tokens), prompts, rids))
    wait_for_lines(follower, before + len(prompts), started, 600)
    return time.perf_counter() - started, answers


def samples_of(follower: ManifestFollower, dump_dir, rids: List[str]) -> Dict[int, object]:
    """The records of the requests `rids`, by their index there."""
    index = {rid: i for i, rid in enumerate(rids)}
    follower.poll()
    return {index[entry["rid"]]: load_dump(str(dump_dir / entry["file"]))
            for entry in follower.entries if entry["rid"] in index}


def row_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)


def streams(record) -> Dict[str, torch.Tensor]:
    """A record's rows per stream: each captured layer id, and "last" (the final state)."""
    return {**{str(layer_id): record.hidden_states[:, k] for k, layer_id in enumerate(record.layer_ids)},
            "last": record.last_hidden_state}


def summarized(errors: Dict[str, List[torch.Tensor]]) -> Dict[str, dict]:
    """Per stream, the mean and max of its per-row relative errors and how many rows they are."""
    joined = {name: torch.cat(values) for name, values in errors.items()}
    return {name: {"mean": float(rows.mean()), "max": float(rows.max()), "rows": int(rows.numel())}
            for name, rows in joined.items() if rows.numel()}


def answer_rows(prompt_len: int, n: int) -> slice:
    return slice(prompt_len, n)


def prompt_rows(prompt_len: int, n: int) -> slice:
    return slice(0, prompt_len)


def every_row(prompt_len: int, n: int) -> slice:
    return slice(0, n)


def fidelity(pairs, span) -> Dict[str, dict]:
    """Per stream (captured layer ids, "last"): mean and max of the per-row relative errors of
    the first record of each pair against the second, over the rows `span(prompt_len, n)`."""
    errors: Dict[str, List[torch.Tensor]] = {}
    for prompt_len, first, second in pairs:
        rows = span(prompt_len, first.token_ids.shape[0])
        theirs = streams(second)
        for name, values in streams(first).items():
            errors.setdefault(name, []).append(row_errors(values[rows], theirs[name][rows]))
    return summarized(errors)


def suite_answers(run) -> dict:
    load = run.preset["answers"]
    prompts = prompts_for(load["requests"], load["prompt_len"], seed=3000)
    dump_dir = run.work / "dump-answers"
    seconds: Dict[str, List[float]] = {how: [] for how in PASSES}
    kept: Dict[str, List[Dict[str, object]]] = {how: [] for how in PASSES}  # per round: rid -> record
    answers: Dict[str, List[List[List[int]]]] = {how: [] for how in PASSES}
    comparison: Optional[dict] = None

    def result() -> dict:
        rounds = min(len(values) for values in seconds.values())
        ratio = [one / two for one, two in zip(seconds["one pass"], seconds["two passes"])]
        return {"seconds": {how: summary(values[:rounds]) for how, values in seconds.items()},
                "one_pass_over_two": summary(ratio) if ratio else None,
                "fidelity": comparison, "rounds": rounds, "decode_graphs_serve_answers": graphs,
                "workload": f"{load['requests']} prompts of {load['prompt_len']} tokens a round, "
                            f"{load['in_flight']} in flight, {load['max_new_tokens']} new tokens each (ignore_eos)"}

    env = {"SGLANG_HS_DUMP_DIR": str(dump_dir), "SGLANG_HS_DUMP_SAMPLE": "0"}
    graphs = bool(run.contenders and "graphs" in run.contenders)
    if graphs:
        env["SGLANG_HS_DUMP_ANSWER_GRAPHS"] = "1"
    server = run.start_server("answers", env)
    try:
        server.wait_ready()
        follower = ManifestFollower(str(dump_dir))
        for round_index in [-1, *run.rounds()]:  # round -1 warms up and is not kept
            order = PASSES if round_index % 2 == 0 else PASSES[::-1]
            for how in order:
                rids = [f"{how.replace(' ', '-')}-{round_index}-{i}" for i in range(len(prompts))]
                took, round_answers = run_round(server, follower, prompts, rids, load["max_new_tokens"],
                                                load["in_flight"], one_pass if how == "one pass" else two_passes)
                if round_index >= 0:
                    seconds[how].append(took)
                    answers[how].append(round_answers)
                    if len(kept[how]) < 2:  # two rounds' records for the comparison
                        kept[how].append(samples_of(follower, dump_dir, rids))
                clear_files(dump_dir)
            if round_index >= 0:
                if comparison is None and len(kept["two passes"]) == 2 and kept["one pass"]:
                    comparison = compare(prompts, answers, kept)
                run.checkpoint(result())
                run.progress(f"answers: round {round_index + 1}: " + ", ".join(
                    f"{how} {values[-1]:.2f}s" for how, values in seconds.items()))
    finally:
        server.stop()
    if comparison is not None:
        comparison["two_launches"] = relaunched(run, env, dump_dir, prompts, load, answers, kept)
        run.checkpoint(result())
        comparison["against_transformers"] = against_transformers(run.model, prompts, answers, kept)
    return result()


def relaunched(run, env, dump_dir, prompts, load, answers, kept) -> dict:
    """What two launches of the same server differ by: a second launch runs a round of each
    way, whose samples are compared with the first launch's first round where the tokens agree."""
    clear_files(dump_dir)
    again: Dict[str, tuple] = {}
    with run.start_server("answers-relaunched", env) as server:
        server.wait_ready()
        follower = ManifestFollower(str(dump_dir))
        for how in PASSES:
            rids = [f"{how.replace(' ', '-')}-relaunched-{i}" for i in range(len(prompts))]
            _, round_answers = run_round(server, follower, prompts, rids, load["max_new_tokens"], load["in_flight"],
                                         one_pass if how == "one pass" else two_passes)
            again[how] = (round_answers, samples_of(follower, dump_dir, rids))
            clear_files(dump_dir)
    compared = {}
    for how in PASSES:
        first, second = kept[how][0], again[how][1]
        same = [i for i in range(len(prompts))
                if answers[how][0][i] == again[how][0][i] and i in first and i in second
                and first[i].token_ids.tolist() == second[i].token_ids.tolist()]
        compared[how.replace(" ", "_")] = dict(
            fidelity([(len(prompts[i]), first[i], second[i]) for i in same], every_row),
            samples_with_equal_tokens=len(same))
    return compared


def agreeing(prompts, answers, kept) -> List[int]:
    """The prompts whose answer and sample tokens are the same in the first round's one pass
    and in the two rounds' two passes."""
    one, two, again = kept["one pass"][0], kept["two passes"][0], kept["two passes"][1]
    return [i for i in range(len(prompts))
            if answers["one pass"][0][i] == answers["two passes"][0][i] == answers["two passes"][1][i]
            and one[i].token_ids.tolist() == two[i].token_ids.tolist() == again[i].token_ids.tolist()]


def against_transformers(model, prompts, answers, kept) -> dict:
    """The answer rows of up to REFERENCE_SAMPLES agreeing samples, the one-pass (decode) rows
    and the two-pass (prefill) rows, against transformers in float32 on the same tokens, beside
    transformers' own bf16 against float32: which of the two is nearer the value bf16
    approximates, and how near bf16 itself comes."""
    chosen = agreeing(prompts, answers, kept)[:REFERENCE_SAMPLES]
    one, two = kept["one pass"][0], kept["two passes"][0]
    tokens = [one[i].token_ids.tolist() for i in chosen]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    float32 = transformers_rows(model, tokens, torch.float32, device)
    bf16 = transformers_rows(model, tokens, torch.bfloat16, device)
    errors: Dict[str, Dict[str, List[torch.Tensor]]] = {
        "one_pass_decode_rows": {}, "two_passes_prefill_rows": {}, "transformers_bf16": {}}
    for k, i in enumerate(chosen):
        rows = answer_rows(len(prompts[i]), len(tokens[k]))
        for name, record in (("one_pass_decode_rows", one[i]), ("two_passes_prefill_rows", two[i])):
            for stream, values in streams(record).items():
                errors[name].setdefault(stream, []).append(row_errors(values[rows], float32[k][stream][rows]))
        for stream in errors["one_pass_decode_rows"]:
            errors["transformers_bf16"].setdefault(stream, []).append(
                row_errors(bf16[k][stream][rows], float32[k][stream][rows]))
    return {"samples": len(chosen), "device": device, **{name: summarized(by_stream) for name, by_stream in errors.items()}}


def compare(prompts, answers, kept) -> dict:
    """The one-pass samples of the first round against the two-pass samples of the first, and
    the two-pass samples of two rounds against each other, where their tokens agree."""
    one, two, again = kept["one pass"][0], kept["two passes"][0], kept["two passes"][1]
    same = agreeing(prompts, answers, kept)
    return {
        "samples_with_equal_tokens": len(same), "samples": len(prompts),
        "decode_rows_vs_prefill": fidelity([(len(prompts[i]), one[i], two[i]) for i in same], answer_rows),
        "prefill_vs_prefill_two_rounds": fidelity([(len(prompts[i]), two[i], again[i]) for i in same], every_row),
        "prompt_rows_one_pass_vs_two": fidelity([(len(prompts[i]), one[i], two[i]) for i in same], prompt_rows),
    }
