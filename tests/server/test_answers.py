"""Dumped answers on a real CPU server: a request whose custom_params ask for its answer
(ANSWER_PARAM), or any dumped request of a server with SGLANG_HS_DUMP_ANSWERS set, gives one
sample of its prompt's rows and the rows of every token it decoded, one row for each token fed
back (the prompt and the answer but its last token), written when it finishes.

- Row for row, the sample equals SGLang's own values at the dumped points, recorded by the
  oracle's forward hooks in every forward, decode steps included; requests that do not ask
  keep prompt-only samples beside them, in the same batches (chunked prefills and mixed
  prefill+decode batches among them).
- The decode rows equal a forward of the same tokens by transformers (float32, from the same
  weights), within what bf16 allows: at most twice the error of transformers' own bf16
  forward. On the CPU this holds for the stream entering layer 1 only. SGLang's DeepSeek
  prefill attention is wrong there upstream, so the prompt's rows, and the latent KV cache
  that the prefill writes for every layer after the first, are not what transformers
  computes; a decode step at layer 1 or later attends to those. Layer 1 is still a decode
  step's whole path: its attention over the prompt's cache, its MLP and the residual.
  SGLang's own prefill is no reference on the CPU for the same reason. The oracle test above
  checks every layer.
- Negative controls: the same rows one position off fail both comparisons; a private request
  that asks for its answer is never dumped, and one that declines the dump is not dumped
  under SGLANG_HS_DUMP_ANSWERS either.
"""

import random

import pytest
import torch

from scripts.dump_format import (
    ANSWER_PARAM, ANSWER_TOKENS_FIELD, DUMP_PARAM, META_INFO_KEY, PRIVATE_PARAM, load_dump, read_manifest)
from scripts.dumps.server import Server, runtime_env, wait_for_manifest
from tests.server import oracle_hooks
from tests.server.dump_checks import OracleServer, assert_matches_oracle, dump_stats, post_all, relative_errors

NUM_LAYERS = 3
VOCAB_SIZE = 1024
FIRST_PROMPT_TOKEN = 100  # output tokens lie below: a decode row is never taken for a prompt row


def workload(seed: int, lengths, output_tokens):
    """Prompts of the given lengths (distinct first tokens) and, per request, the one token a
    logit bias makes it decode (distinct per request): every row's (position, token) names
    its request."""
    rng = random.Random(seed)
    firsts = rng.sample(range(FIRST_PROMPT_TOKEN, VOCAB_SIZE), len(lengths))
    prompts = [[first] + [rng.randrange(FIRST_PROMPT_TOKEN, VOCAB_SIZE) for _ in range(n - 1)]
               for first, n in zip(firsts, lengths)]
    return prompts, list(output_tokens)


def body(prompt, rid: str, max_new_tokens: int, output_token, **custom_params) -> dict:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
                "custom_params": custom_params}
    if output_token is not None:
        sampling["logit_bias"] = {str(output_token): 100.0}
    return {"rid": rid, "input_ids": list(prompt), "sampling_params": sampling}


def test_answers_equal_the_oracle_row_for_row(model_l3, tmp_path):
    answer_lengths = [1, 2, 3, 8, 16, 24, 33, 40]  # new tokens; 1: the sample is the prompt
    lengths = [1, 17, 64, 65, 130, 200, 9, 150] + [40, 120, 70, 5] + [30]
    prompts, outputs = workload(3, lengths, range(10, 10 + len(lengths)))
    bodies = [body(prompts[i], f"answer-{i}", n, outputs[i], **{ANSWER_PARAM: True})
              for i, n in enumerate(answer_lengths)]
    plain = range(len(answer_lengths), len(answer_lengths) + 4)
    bodies += [body(prompts[i], f"plain-{i}", 12, outputs[i]) for i in plain]
    private = len(lengths) - 1
    bodies.append(body(prompts[private], "private", 8, outputs[private], **{ANSWER_PARAM: True, PRIVATE_PARAM: True}))
    server = OracleServer(model_l3, tmp_path, NUM_LAYERS, ["--enable-mixed-chunk", "--chunked-prefill-size", "64"],
                          record_decode=True)
    with server:
        server.wait_ready()
        assert "answers=asked" in server.log()
        responses = dict(zip((b["rid"] for b in bodies), post_all(server, bodies, workers=16)))
        manifest = wait_for_manifest(server.dump_dir, len(bodies) - 1)
    for b in bodies:
        n = b["sampling_params"]["max_new_tokens"]
        assert responses[b["rid"]]["output_ids"] == [int(next(iter(b["sampling_params"]["logit_bias"])))] * n

    by_rid = {entry["rid"]: entry for entry in manifest}
    assert sorted(by_rid) == sorted(b["rid"] for b in bodies if b["rid"] != "private") and len(manifest) == len(by_rid)
    # Each request's sequence: the tokens fed back, one row each.
    sequences = {b["rid"]: b["input_ids"] + responses[b["rid"]]["output_ids"][:-1] for b in bodies}
    streams, forwards = oracle_hooks.request_rows(
        server.oracle_dir, {rid: sequences[rid] if rid.startswith("answer") else sequences[rid][:len(prompt)]
                            for rid, prompt in ((b["rid"], b["input_ids"]) for b in bodies) if rid in by_rid})
    for b in bodies[:len(answer_lengths)]:
        rid, entry = b["rid"], by_rid[b["rid"]]
        answer_tokens = b["sampling_params"]["max_new_tokens"] - 1
        assert entry[ANSWER_TOKENS_FIELD] == answer_tokens, entry
        assert entry["num_tokens"] == len(b["input_ids"]) + answer_tokens
        record = load_dump(str(server.dump_dir / entry["file"]))
        assert_matches_oracle(record, sequences[rid], streams[rid], rid)
        [reported] = responses[rid]["meta_info"][META_INFO_KEY]
        assert reported["file"] == entry["file"], (rid, reported)
        if answer_tokens >= 2:
            # Negative control: the answer's rows one position off are not the oracle's.
            start = len(b["input_ids"])
            assert not torch.equal(record.hidden_states[start + 1:, 0], streams[rid][str(record.layer_ids[0])][start:-1])
    for i in plain:
        rid = f"plain-{i}"
        assert ANSWER_TOKENS_FIELD not in by_rid[rid] and by_rid[rid]["num_tokens"] == len(prompts[i])
        assert_matches_oracle(load_dump(str(server.dump_dir / by_rid[rid]["file"])), prompts[i], streams[rid], rid)
    assert not (responses["private"]["meta_info"].get(META_INFO_KEY) or [None])[0]

    # The workload did what it is for: decode steps of several answers in one forward, and a
    # prompt's chunk beside answer rows in one forward.
    decode_rows = [f for f in forwards if f.prompts and f.prompt_rows == len(f.prompts) and len(f.prompts) >= 2]
    assert decode_rows, "no forward decoded several dumped answers"
    stats = dump_stats(server.log())
    assert stats is None or stats["errors"] == 0, stats


def test_decode_rows_equal_a_transformers_forward_of_the_same_tokens(model_l3, tmp_path):
    from transformers import AutoModelForCausalLM

    prompts, _ = workload(5, [37], [None])
    out = tmp_path / "dump"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_LAYERS="1")
    with Server(model_l3, tmp_path / "server.log", env) as server:
        server.wait_ready()
        answer = server.post("/generate", body(prompts[0], "free", 48, None, **{ANSWER_PARAM: True}))
        [entry] = wait_for_manifest(out, 1)
    tokens = prompts[0] + answer["output_ids"][:-1]
    record = load_dump(str(out / entry["file"]))
    assert record.token_ids.tolist() == tokens and entry[ANSWER_TOKENS_FIELD] == 47
    assert len(set(answer["output_ids"])) > 1, "the answer repeats one token: a weak comparison"

    def forward(dtype):
        model = AutoModelForCausalLM.from_pretrained(str(model_l3), dtype=dtype).eval()
        with torch.no_grad():
            states = model.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        return {1: states[1][0].float()}  # the stream entering layer 1

    reference, bf16 = forward(torch.float32), forward(torch.bfloat16)
    decoded = slice(len(prompts[0]), len(tokens))
    dumped = {1: record.hidden_states[:, 0]}
    for name, rows in dumped.items():
        allowed = relative_errors(bf16[name][decoded], reference[name][decoded]).mean()
        error = relative_errors(rows[decoded], reference[name][decoded]).mean()
        print(f"layer {name}: decode rows {error:.4f}, transformers bf16 {allowed:.4f}")
        assert error <= 2 * allowed, (name, float(error), float(allowed))
        # Negative control: the same rows one position off.
        shifted = relative_errors(rows[decoded][1:], reference[name][decoded][:-1]).mean()
        assert shifted > 2 * allowed, (name, float(shifted), float(allowed))


@pytest.mark.parametrize("setting", ["server", "request"])
def test_who_asks_for_answers_and_who_declines(model_l3, tmp_path, setting):
    out = tmp_path / "dump"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_LAYERS="1",
                      **({"SGLANG_HS_DUMP_ANSWERS": "1"} if setting == "server" else {}))
    prompts, outputs = workload(9, [20, 21, 22, 23], [10, 11, 12, 13])
    asks = {ANSWER_PARAM: True} if setting == "request" else {}
    bodies = [body(prompts[0], "asks", 6, outputs[0], **asks),
              body(prompts[1], "declines", 6, outputs[1], **asks, **{DUMP_PARAM: False}),
              body(prompts[2], "private", 6, outputs[2], **asks, **{PRIVATE_PARAM: True}),
              body(prompts[3], "prompt-only", 6, outputs[3])]
    with Server(model_l3, tmp_path / "server.log", env) as server:
        server.wait_ready()
        assert f"answers={'all' if setting == 'server' else 'asked'}" in server.log()
        post_all(server, bodies, workers=4)
        server.post("/generate", body(prompts[3], "last", 1, None, **{DUMP_PARAM: True}))
        wait_until_listed(out, "last")
    entries = {e["rid"]: e for e in read_manifest(str(out))}
    assert sorted(entries) == ["asks", "last", "prompt-only"]
    assert entries["asks"][ANSWER_TOKENS_FIELD] == 5 and entries["asks"]["num_tokens"] == 25
    if setting == "server":
        assert entries["prompt-only"][ANSWER_TOKENS_FIELD] == 5
    else:
        assert ANSWER_TOKENS_FIELD not in entries["prompt-only"] and entries["prompt-only"]["num_tokens"] == 23


def wait_until_listed(out, rid: str) -> None:
    from tests.server.test_regenerate import wait_for
    wait_for(lambda: rid in {e["rid"] for e in read_manifest(str(out))}, f"{rid}'s manifest line")
