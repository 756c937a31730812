"""Which live requests a real CPU server dumps (SGLANG_HS_DUMP_SAMPLE, SGLANG_HS_DUMP_SAMPLE_SEED,
and each request's custom_params): a sampled fraction of the requests that neither ask nor
decline, exactly those RequestSample's keyed hash takes under the server's seed and within the
binomial bounds; every request that asks; never a private or declining one, whatever else it
sets. Fraction 0 dumps only those that ask. The manifest lines record the sample and whether
each request asked; the responses report where only the dumped ones are. (A bad setting
stops the server: test_warmup's invalid settings.)

On a server dumping every request (fraction 1, as live traffic was checked), streaming whole
chunks or incremental ones: every dumped request's last output says where its sample is,
streamed or not, prompt only or with its answer, at lengths either side of the 50 tokens at
which SGLang sends a non-streamed request's outputs; a request that declines reports none
(the negative control). custom_params that are
not what the dump documents (not an object, a non-boolean where a boolean belongs, a loss mask
that is no list of counts) refuse the request with an error naming the field, and nothing of
it is dumped; the server goes on serving."""

import json
import math
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import pytest
from sglang.srt.hidden_states_dump.config import RequestSample

from scripts.dump_format import (
    ANSWER_PARAM,
    ANSWER_TOKENS_FIELD,
    DUMP_PARAM,
    LOSS_MASK_PARAM,
    META_INFO_KEY,
    PRIVATE_PARAM,
    REQUEST_SAMPLE_FIELD,
    read_manifest,
    sample_name,
)
from scripts.dumps.generate import Client
from scripts.dumps.server import Server, runtime_env
from tests.server.dump_checks import RELEASE
from tests.server.test_generate import DUMP_LAYERS
from tests.server.test_regenerate import wait_for

SEED = 7
PLAIN = 64


def post(server, rid: str, number: int, **custom_params) -> dict:
    return Client(server.url).post("/generate", {
        "rid": rid, "input_ids": [5, 6, 7, number % 50 + 8, number % 7 + 60],
        "sampling_params": {"temperature": 0, "max_new_tokens": 1, "custom_params": custom_params}})


def requests_sent() -> dict:
    """rid -> custom_params of every request the test sends, in order."""
    sent = {f"live-{i}": {} for i in range(PLAIN)}
    sent.update({f"asked-{i}": {DUMP_PARAM: True} for i in range(4)})
    sent.update({f"private-asked-{i}": {PRIVATE_PARAM: True, DUMP_PARAM: True} for i in range(3)})
    sent.update({f"private-{i}": {PRIVATE_PARAM: 1} for i in range(3)})
    sent.update({f"declined-{i}": {DUMP_PARAM: False} for i in range(3)})
    return sent


@pytest.mark.parametrize("fraction", [0.25, 0.0])
def test_the_server_dumps_its_sample_and_the_requests_that_ask(model_l3, tmp_path, fraction):
    out = tmp_path / "dump"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_LAYERS=DUMP_LAYERS,
                      SGLANG_HS_DUMP_SAMPLE=str(fraction), SGLANG_HS_DUMP_SAMPLE_SEED=str(SEED))
    sent = requests_sent()
    with Server(model_l3, tmp_path / "server.log", env) as server:
        server.wait_ready()
        assert f"requests={'asked' if fraction == 0 else f'asked+sample(fraction={fraction:g},seed={SEED})'}" in server.log()
        with ThreadPoolExecutor(8) as pool:  # batches mix sampled, asking and private requests
            answers = dict(zip(sent, pool.map(lambda item: post(server, item[0], len(item[0]), **item[1]),
                                              sent.items())))
        # Lines are published in submission order: once the last request's is there, all are.
        post(server, "asked-last", 0, **{DUMP_PARAM: True})
        wait_for(lambda: "asked-last" in {e["rid"] for e in read_manifest(str(out))}, "the last request's line")

    sample = RequestSample(fraction, SEED)
    live = [rid for rid in sent if rid.startswith("live-")]
    expected = {rid for rid in live if sample.takes(rid)} | {rid for rid in sent if rid.startswith("asked-")}
    entries = [e for e in read_manifest(str(out)) if e["rid"] != "asked-last"]
    dumped = {e["rid"] for e in entries}
    assert len(entries) == len(dumped)
    assert dumped == expected
    # (a response that reports none has no entry, or a list holding None)
    assert {rid for rid, answer in answers.items() if (answer["meta_info"].get(META_INFO_KEY) or [None])[0]} == expected
    assert all(e[REQUEST_SAMPLE_FIELD] == {"fraction": fraction, "seed": SEED} for e in entries)
    assert {e["rid"] for e in entries if e["asked"]} == {rid for rid in sent if rid.startswith("asked-")}

    taken = len(dumped & set(live))
    spread = 4 * math.sqrt(PLAIN * fraction * (1 - fraction))
    assert PLAIN * fraction - spread <= taken <= PLAIN * fraction + spread
    if fraction:
        # Negative control: another seed takes another set of these requests.
        other = RequestSample(fraction, SEED + 1)
        assert {rid for rid in live if other.takes(rid)} != dumped & set(live)
    else:
        assert taken == 0


# The held-out check's prompt, and new tokens either side of SGLang's force stream interval: a
# non-streamed request's outputs go every 50 tokens (SGLANG_FORCE_STREAM_INTERVAL) and at its
# finish, a streamed one's every token.
LIVE_PROMPT = [2, 3, 7, 10, 11, 12, 13, 4, 3, 8]
LENGTHS = (49, 50, 51, 120)


# SGLang streams a response in one of two ways: each chunk holds everything so far (the
# default), or only what is new (its meta_info then holds the values of the chunk's own tokens).
INCREMENTAL_STREAMING = ["--incremental-streaming-output"] if RELEASE >= (0, 5, 14) else ["--stream-output"]


@pytest.fixture(scope="module", params=["whole chunks", "incremental chunks"])
def dumping_every_request(model_l3, tmp_path_factory, request):
    """A server dumping every request (SGLANG_HS_DUMP_SAMPLE=1), its dump folder, and
    whether it streams incrementally."""
    tmp = tmp_path_factory.mktemp("every-request")
    out = tmp / "dump"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_LAYERS=DUMP_LAYERS, SGLANG_HS_DUMP_SAMPLE="1")
    incremental = request.param == "incremental chunks"
    with Server(model_l3, tmp / "server.log", env, INCREMENTAL_STREAMING if incremental else []) as server:
        server.wait_ready()
        yield server, out, incremental


def outputs(server, body: dict, stream: bool) -> List[dict]:
    """A /generate request's outputs as its client gets them: the answer, or every streamed
    chunk in order."""
    request = urllib.request.Request(f"{server.url}/generate", data=json.dumps(dict(body, stream=stream)).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        if not stream:
            return [json.loads(response.read())]
        return [json.loads(line[len(b"data: "):]) for line in map(bytes.strip, response)
                if line.startswith(b"data: ") and line != b"data: [DONE]"]


def live_body(rid: str, max_new_tokens: int, custom_params) -> dict:
    return {"rid": rid, "input_ids": LIVE_PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, "custom_params": custom_params}}


def reported_sample(output: dict) -> Optional[str]:
    """The sample an output says its request's is (None: it names none)."""
    reported = [location for location in output["meta_info"].get(META_INFO_KEY) or [] if location]
    assert len(reported) <= 1, reported
    return sample_name(reported[0]) if reported else None


def test_every_dumped_requests_last_output_says_where_its_sample_is(dumping_every_request):
    server, out, incremental = dumping_every_request
    asks = {"prompt": {}, "answer": {ANSWER_PARAM: True}, "declined": {DUMP_PARAM: False}}
    cases = {f"{kind}-{n}-{'streamed' if stream else 'whole'}": (kind, n, stream)
             for kind in ("prompt", "answer") for n in LENGTHS for stream in (False, True)}
    # The negative control: requests that decline are answered, not dumped, and report nothing.
    cases.update({f"declined-51-{'streamed' if stream else 'whole'}": ("declined", 51, stream) for stream in (False, True)})
    # All at once: batch outputs mix requests that report a location with requests that do not.
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = dict(zip(cases, pool.map(
            lambda item: outputs(server, live_body(item[0], item[1][1], asks[item[1][0]]), item[1][2]), cases.items())))
    dumped = {rid for rid, (kind, _, _) in cases.items() if kind != "declined"}
    wait_for(lambda: dumped <= {e["rid"] for e in read_manifest(str(out))}, "every dumped request's line")
    entries = {e["rid"]: e for e in read_manifest(str(out))}

    for rid, (kind, n, stream) in cases.items():
        last = answers[rid][-1]
        assert last["meta_info"]["finish_reason"]["type"] == "length", (rid, last["meta_info"])
        sent = sum(len(a["output_ids"]) for a in answers[rid]) if stream and incremental else len(last["output_ids"])
        assert sent == n and (len(answers[rid]) > 1) == stream, rid
        if kind == "declined":
            assert rid not in entries and reported_sample(last) is None, (rid, last["meta_info"])
            continue
        assert reported_sample(last) == entries[rid]["file"], (rid, last["meta_info"].get(META_INFO_KEY))
        if kind == "answer":
            assert entries[rid][ANSWER_TOKENS_FIELD] == n - 1, entries[rid]
        else:
            assert ANSWER_TOKENS_FIELD not in entries[rid], entries[rid]


# custom_params that are not what the dump documents, and the field each error names.
MALFORMED = {
    "params-a-string": ("hidden_states_dump", "sampling_params.custom_params must be a JSON object"),
    "params-a-list": ([DUMP_PARAM], "sampling_params.custom_params must be a JSON object"),
    "dump-a-string": ({DUMP_PARAM: "false"}, f"sampling_params.custom_params.{DUMP_PARAM} must be true or false"),
    "dump-null": ({DUMP_PARAM: None}, f"sampling_params.custom_params.{DUMP_PARAM} must be true or false"),
    "answer-a-string": ({ANSWER_PARAM: "true"}, f"sampling_params.custom_params.{ANSWER_PARAM} must be true or false"),
    "mask-a-string": ({LOSS_MASK_PARAM: "all"}, f"sampling_params.custom_params.{LOSS_MASK_PARAM} must be a list"),
}


def refusal(server, body: dict, stream: bool) -> str:
    """The error a refused request gets: HTTP 400 with a message, or, streamed, a last chunk
    aborted with status 400 and the message."""
    if not stream:
        with pytest.raises(urllib.error.HTTPError) as refused:
            outputs(server, body, stream=False)
        assert refused.value.code == 400, refused.value
        return json.loads(refused.value.read())["error"]["message"]
    finish = outputs(server, body, stream=True)[-1]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish.get("status_code") == 400, finish
    return finish["message"]


def test_malformed_dump_params_refuse_the_request_naming_the_field(dumping_every_request):
    server, out, _ = dumping_every_request
    refused = set()
    for name, (custom_params, error) in MALFORMED.items():
        for stream in (False, True):
            rid = f"malformed-{name}-{'streamed' if stream else 'whole'}"
            message = refusal(server, live_body(rid, 4, custom_params), stream)
            assert error in message, (rid, message)
            refused.add(rid)
    # Negative controls: what the dump documents is served (private read loosely, toward privacy).
    for rid, custom_params in (("well-formed-declined", {DUMP_PARAM: False}), ("well-formed-private", {PRIVATE_PARAM: "yes"}),
                               ("well-formed-other", {"some_logit_processor_param": "x"})):
        assert len(outputs(server, live_body(rid, 4, custom_params), stream=False)[0]["output_ids"]) == 4
    # The server goes on serving; lines are published in submission order: once this request's
    # is there, a line of any request before it would be.
    outputs(server, live_body("asked-after-malformed", 2, {DUMP_PARAM: True}), stream=False)
    wait_for(lambda: "asked-after-malformed" in {e["rid"] for e in read_manifest(str(out))}, "the last request's line")
    dumped = {e["rid"] for e in read_manifest(str(out))}
    assert not dumped & refused, dumped & refused
    assert "well-formed-other" in dumped and not {"well-formed-declined", "well-formed-private"} & dumped
