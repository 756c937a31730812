"""Which live requests a real CPU server dumps (SGLANG_HS_DUMP_SAMPLE, SGLANG_HS_DUMP_SAMPLE_SEED,
and each request's custom_params): a sampled fraction of the requests that neither ask nor
decline, exactly those RequestSample's keyed hash takes under the server's seed and within the
binomial bounds; every request that asks; never a private or declining one, whatever else it
sets. Fraction 0 dumps only those that ask. The manifest lines record the sample and whether
each request asked; the responses report where only the dumped ones are. (A bad setting
stops the server: test_warmup's invalid settings.)"""

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
from sglang.srt.hidden_states_dump.config import RequestSample

from scripts.dump_format import DUMP_PARAM, META_INFO_KEY, PRIVATE_PARAM, REQUEST_SAMPLE_FIELD, read_manifest
from scripts.dumps.generate import Client
from scripts.dumps.server import Server, runtime_env
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
