"""Dumped answers, driven as the model and the scheduler drive them: which requests of a
batch carry their answer's rows (requests.requests_to_dump, finish_dumped_requests), and the
dumper stitching a prompt's rows and its decode steps' rows into one sample at the request's
finish, cutting the overlap scheduler's step past the finish, and writing nothing for a
request that was aborted or retracted, whose rows have a gap, or whose rows hold other tokens;
the request's last output, and no output before it, saying where its sample is."""

from types import SimpleNamespace

import pytest

from sglang.srt.hidden_states_dump import requests as dump_requests
from sglang.srt.hidden_states_dump.capture import with_answer_in_loss
from sglang.srt.hidden_states_dump.format import ANSWER_PARAM, ANSWER_TOKENS_FIELD, META_INFO_KEY, PRIVATE_PARAM
from sglang.srt.hidden_states_dump.requests import DumpRequest
from tests.unit.dump_standins import (
    SchedulerReq,
    assert_dumped,
    next_output_reports,
    prompt,
    run_decode,
    run_forward,
    start_dumper,
    wait_for_manifest,
    wait_for_stats,
)

LAYERS = [0, 2, 4]


def finished_req(rid, origin, output, finish="length", retractions=0):
    """A scheduler Req as finish_answer reads it."""
    return SchedulerReq(rid, origin, output, retraction_count=retractions).finish(finish)


def decode_answer(dumper, rid, prompt_len, tokens, first_position=None):
    """Decode steps of one request whose answer is dumped, one token each."""
    position = prompt_len if first_position is None else first_position
    for offset, token in enumerate(tokens):
        run_decode(dumper, [token], [DumpRequest(rid, prompt_len, answer=True, decoding=True)], [position + offset])


def test_a_prompt_and_its_answer_are_one_sample_at_the_finish(dump_dir):
    dumper = start_dumper(dump_dir, LAYERS)
    a, b = prompt(100, 5), prompt(200, 3)
    answer = [900, 901, 902, 903]
    run_forward(dumper, [(DumpRequest("a", 5, answer=True), a, 0), (DumpRequest("b", 3), b, 0)])
    wait_for_manifest(dump_dir, ["b"])  # a prompt-only sample is written at once
    # Decode steps: `a`'s answer beside a request whose answer is not dumped, then the step
    # the overlap scheduler runs past the finish (its last token fed back once more).
    for offset, token in enumerate(answer):
        run_decode(dumper, [token, 500 + offset], [DumpRequest("a", 5, answer=True, decoding=True), None],
                   [5 + offset, 3 + offset])
    dumper.finish_answer(finished_req("a", a, answer[:3] + [777]))
    lines = {line["rid"]: line for line in wait_for_manifest(dump_dir, ["a", "b"])}

    assert_dumped(dump_dir, lines["a"], a + answer[:2] + [902], LAYERS)
    assert lines["a"][ANSWER_TOKENS_FIELD] == 3 and lines["a"]["num_tokens"] == 8
    assert ANSWER_TOKENS_FIELD not in lines["b"]


@pytest.mark.parametrize("outputs_before", [0, 1, 50])
def test_the_last_output_says_where_the_sample_is(dump_dir, outputs_before):
    """Where a sample is goes into the request's last output, and into no output before it,
    however many tokens those sent (a non-streamed request sends an output every 50 tokens, a
    streamed one every few): a prompt's sample, submitted at its prefill, and an answer's,
    submitted at the finish. The negative control, a request not dumped, reports nothing."""
    dumper = start_dumper(dump_dir, LAYERS)
    a, b, c = prompt(100, 5), prompt(200, 3), prompt(300, 2)
    reqs = {rid: SchedulerReq(rid, origin) for rid, origin in (("a", a), ("b", b), ("c", c))}
    run_forward(dumper, [(DumpRequest("a", 5, req=reqs["a"], answer=True), a, 0),
                         (DumpRequest("b", 3, req=reqs["b"]), b, 0), (None, c, 0)])
    answer = [900 + i for i in range(outputs_before + 1)]
    for offset, token in enumerate(answer[:-1]):
        run_decode(dumper, [token], [DumpRequest("a", 5, answer=True, decoding=True)], [5 + offset])
    for req in reqs.values():
        req.output_ids = list(answer)
        req.send_token_offset = outputs_before
    dump_requests.finish_dumped_requests(reqs.values())  # none finished: no output reports one
    assert all(not next_output_reports(req) for req in reqs.values())
    for req in reqs.values():
        req.finish()
    dumper.finish_answer(reqs["a"])  # as finish_dumped_requests does for a request requests_to_dump took
    dump_requests.finish_dumped_requests(reqs.values())
    lines = {line["rid"]: line for line in wait_for_manifest(dump_dir, ["a", "b"])}
    for rid in "ab":
        [location] = next_output_reports(reqs[rid])
        assert location["file"] == lines[rid]["file"]
        assert not any(reqs[rid].customized_info[META_INFO_KEY][:outputs_before])
    assert lines["a"][ANSWER_TOKENS_FIELD] == outputs_before
    assert next_output_reports(reqs["c"]) == []


def test_where_chunks_are_sliced_by_token_a_stream_carries_one_value_a_token(dump_dir, monkeypatch):
    """Under --incremental-streaming-output the tokenizer manager hands each chunk of a
    streamed response the values of its own tokens, sliced from all it gathered: every chunk
    of a dumped stream carries one value per token, None but for the location, which is the
    first token's of the last chunk. A request not streamed is answered whole: its values stay
    request-level."""
    monkeypatch.setattr(dump_requests, "dump_enabled", lambda: True)
    dump_requests.set_streams_sliced_by_token(True)
    try:
        streamed = SchedulerReq("streamed", stream=True, max_new_tokens=8)
        whole = SchedulerReq("whole", max_new_tokens=8)
        dump_requests.requests_to_dump([streamed, whole])
        gathered = []  # what the tokenizer manager gathers of the stream, chunk after chunk
        for sent in (1, 4, 6):  # tokens sent by each output before the last
            streamed.output_ids = list(range(sent))
            gathered += next_output_reports(streamed)[:sent - streamed.send_token_offset]
            streamed.send_token_offset = sent
        assert gathered == [None] * 6
        streamed.output_ids, whole.output_ids = list(range(8)), list(range(8))
        whole.send_token_offset = 0
        location = {"sink": "files", "file": "f"}
        for req in (streamed, whole):
            dump_requests.report_in_last_output(req.finish(), location)
        last = next_output_reports(streamed)[:8 - 6]
        assert last == [location, None] and (gathered + last)[6:] == [location, None]
        assert next_output_reports(whole) == [location]
    finally:
        dump_requests.set_streams_sliced_by_token(False)
        dump_requests._answering.clear()


def test_an_answer_of_one_token_is_its_prompt(dump_dir):
    dumper = start_dumper(dump_dir, LAYERS)
    a = prompt(100, 4)
    run_forward(dumper, [(DumpRequest("a", 4, answer=True), a, 0)])
    dumper.finish_answer(finished_req("a", a, [901]))
    [line] = wait_for_manifest(dump_dir, ["a"])
    assert_dumped(dump_dir, line, a, LAYERS)
    assert line[ANSWER_TOKENS_FIELD] == 0


def test_answer_rows_in_an_extend_batch_are_the_answers(dump_dir):
    """A mixed batch built before the prompt's first token was known hands the request as a
    prompt; its row past the prompt is the answer's first."""
    dumper = start_dumper(dump_dir, LAYERS)
    a, c = prompt(100, 4), prompt(300, 6)
    run_forward(dumper, [(DumpRequest("a", 4, answer=True), a, 0), (DumpRequest("c", 6), c[:3], 0)])
    run_forward(dumper, [(DumpRequest("a", 4, answer=True), [900], 4), (DumpRequest("c", 6), c[3:], 3)])
    decode_answer(dumper, "a", 4, [901, 902], first_position=5)
    dumper.finish_answer(finished_req("a", a, [900, 901, 902, 903]))
    lines = {line["rid"]: line for line in wait_for_manifest(dump_dir, ["a", "c"])}
    assert_dumped(dump_dir, lines["a"], a + [900, 901, 902], LAYERS)
    assert_dumped(dump_dir, lines["c"], c, LAYERS)


def test_decode_steps_leave_a_prompt_being_chunked_alone(dump_dir):
    dumper = start_dumper(dump_dir, LAYERS)
    a, c = prompt(100, 3), prompt(300, 6)
    run_forward(dumper, [(DumpRequest("a", 3, answer=True), a, 0), (DumpRequest("c", 6), c[:2], 0)])
    decode_answer(dumper, "a", 3, [900, 901])  # c is not in these forwards
    run_forward(dumper, [(DumpRequest("c", 6), c[2:], 2)])
    dumper.finish_answer(finished_req("a", a, [900, 901, 902]))
    lines = {line["rid"]: line for line in wait_for_manifest(dump_dir, ["a", "c"])}
    assert_dumped(dump_dir, lines["c"], c, LAYERS)
    assert_dumped(dump_dir, lines["a"], a + [900, 901], LAYERS)
    assert wait_for_stats(dumper, lambda s: s["files"] == 2)["discarded"] == 0


@pytest.mark.parametrize("case", ["aborted", "retracted", "rows missing", "gap", "other tokens"])
def test_an_answer_that_cannot_be_whole_writes_nothing(dump_dir, case):
    dumper = start_dumper(dump_dir, LAYERS)
    a = prompt(100, 4)
    run_forward(dumper, [(DumpRequest("a", 4, answer=True), a, 0)])
    answer = [900, 901, 902, 903]
    if case == "gap":
        decode_answer(dumper, "a", 4, [900])
        decode_answer(dumper, "a", 4, [902, 903], first_position=6)
    elif case == "rows missing":
        decode_answer(dumper, "a", 4, answer[:2])
    else:
        decode_answer(dumper, "a", 4, answer[:3])
    output = {"other tokens": [900, 555, 902, 903]}.get(case, answer)
    dumper.finish_answer(finished_req("a", a, output, finish="abort" if case == "aborted" else "length",
                                      retractions=1 if case == "retracted" else 0))
    # Negative control on the same dumper: the next request's answer is written.
    b = prompt(200, 2)
    run_forward(dumper, [(DumpRequest("b", 2, answer=True), b, 0)])
    decode_answer(dumper, "b", 2, [950])
    dumper.finish_answer(finished_req("b", b, [950, 951]))
    [line] = wait_for_manifest(dump_dir, ["b"])
    assert_dumped(dump_dir, line, b + [950], LAYERS)
    expected = {"gap": "errors", "other tokens": "errors"}.get(case, "discarded")
    counters = wait_for_stats(dumper, lambda s: s["files"] == 1 and s[expected] == 1)
    assert counters["errors"] + counters["discarded"] == 1, counters


def test_with_answer_in_loss():
    assert with_answer_in_loss(None, 5) is None
    assert with_answer_in_loss((2, 3), 4) == (2, 7)  # ends with ones: they go on
    assert with_answer_in_loss((2, 3, 1), 4) == (2, 3, 1, 4)  # ends with zeros
    assert with_answer_in_loss((0, 3), 0) == (0, 3)


def scheduler_req(rid, custom_params=None):
    return SchedulerReq(rid, custom_params=custom_params)


def test_which_requests_carry_their_answers(monkeypatch):
    monkeypatch.setattr(dump_requests, "dump_enabled", lambda: True)
    monkeypatch.setattr(dump_requests, "dump_answers", lambda: False)
    finished = []
    dump_requests.on_answer_finished(finished.append)
    asks = scheduler_req("asks", {ANSWER_PARAM: True})
    plain = scheduler_req("plain")
    private = scheduler_req("private", {ANSWER_PARAM: True, PRIVATE_PARAM: True})
    try:
        assert dump_requests.requests_to_dump([plain], is_extend=False) == []  # no answer dumped: nothing
        prefill = dump_requests.requests_to_dump([asks, plain, private])
        assert [(r.rid, r.answer, r.decoding) for r in prefill if r] == [("asks", True, False), ("plain", False, False)]
        assert prefill[2] is None
        # Every output of a dumped request carries the key (empty until the last names the sample).
        assert asks.customized_info == plain.customized_info == {META_INFO_KEY: []}
        assert private.customized_info is None
        for req in (asks, plain, private):
            req.output_ids.append(900)
        decode = dump_requests.requests_to_dump([plain, asks, private], is_extend=False)
        assert decode[0] is None and decode[2] is None and (decode[1].rid, decode[1].decoding) == ("asks", True)
        # In an extend batch (mixed with a prefill), the same.
        assert [r and r.rid for r in dump_requests.requests_to_dump([plain, asks])] == [None, "asks"]
        asks.retraction_count = 1  # once retracted, its steps carry nothing
        assert dump_requests.requests_to_dump([asks], is_extend=False) == [None]
        asks.retraction_count = 0
        dump_requests.finish_dumped_requests([plain, asks])
        assert finished == []  # not finished yet
        asks.finish()
        dump_requests.finish_dumped_requests([plain, asks])
        dump_requests.finish_dumped_requests([asks])
        assert finished == [asks]  # handed over once
        assert dump_requests.requests_to_dump([asks], is_extend=False) == []
    finally:
        dump_requests.on_answer_finished(None)
        dump_requests._answering.clear()


def test_the_server_setting_dumps_every_dumped_requests_answer(monkeypatch):
    monkeypatch.setattr(dump_requests, "dump_enabled", lambda: True)
    monkeypatch.setattr(dump_requests, "dump_answers", lambda: True)
    try:
        plain, declines = scheduler_req("plain"), scheduler_req("declines", {"hidden_states_dump": False})
        prefill = dump_requests.requests_to_dump([plain, declines])
        assert prefill[0].answer and prefill[1] is None
    finally:
        dump_requests._answering.clear()


@pytest.mark.parametrize("graphs_serve", [True, False])
def test_a_replayed_decode_graph_serves_the_answers_from_its_rows(dump_dir, monkeypatch, graphs_serve):
    """With SGLANG_HS_DUMP_ANSWER_GRAPHS, a decode graph leaves its rows in the dump's GraphRows
    (the graph's copy, recorded once at capture, replayed every step: here the copy itself
    stands for a replay) and dump_replayed_decode takes the dumped answers' rows from there, by
    their batch position. Without it (the default: such steps run eagerly) a replay's rows
    are not taken, and the answer, missing them, writes nothing."""
    import torch

    from sglang.srt.hidden_states_dump import capture as dump_capture
    from sglang.srt.hidden_states_dump import requests as dump_requests
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from tests.unit.dump_standins import final_rows, layer_rows

    monkeypatch.setattr(dump_capture, "answer_graphs", lambda: graphs_serve)
    monkeypatch.setattr(dump_requests, "answer_graphs", lambda: graphs_serve)
    dumper = start_dumper(dump_dir, LAYERS)
    a = prompt(100, 3)
    run_forward(dumper, [(DumpRequest("a", 3, answer=True), a, 0)])
    graph_bs = 4  # the graph's padded batch: two real requests, `a` second

    def replay(tokens):
        """What a replay of the graph for these tokens leaves in the dump's buffers."""
        padded = tokens + [0] * (graph_bs - len(tokens))
        dumper.graph_rows.record(final_rows(padded), [layer_rows(padded, i) for i in sorted(LAYERS)])
        forward_batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, batch_size=len(tokens),
            hidden_states_dump_requests=[None, DumpRequest("a", 3, answer=True, decoding=True)],
            seq_lens_cpu=torch.tensor([50, len(a) + 1 + step]), input_ids=torch.tensor(tokens))
        dump_capture.dump_replayed_decode(forward_batch)

    for step, token in enumerate([900, 901]):
        replay([700 + step, token])
    # The graph replays only where it serves the dump: otherwise the step runs eagerly.
    assert dump_requests.decode_graph_misses_dump([None, DumpRequest("a", 3, answer=True, decoding=True)]) \
        == (not graphs_serve)
    dumper.finish_answer(finished_req("a", a, [900, 901, 902]))
    if graphs_serve:
        [line] = wait_for_manifest(dump_dir, ["a"])
        assert_dumped(dump_dir, line, a + [900, 901], LAYERS)
    else:
        assert wait_for_stats(dumper, lambda s: s["discarded"] == 1)["files"] == 0



def count_copies(dumper):
    """The row count of each copy the dumper's copier is handed from now on."""
    copies = []
    submit = dumper._copier.submit

    def counted(rows, *args, **kwargs):
        copies.append(len(rows["token_ids"]))
        return submit(rows, *args, **kwargs)

    dumper._copier.submit = counted
    return copies


def test_decode_rows_are_staged_and_go_to_the_host_together(dump_dir):
    """A decode step's answer rows are staged on the forward's device (staged_answers) and go to
    the host in one copy once the staging is full, a request among them finishes, or a forward
    the staging does not take comes; a step of more rows than it holds goes alone. Three
    answers over five steps with a staging of three rows, a prefill between steps, batch
    orders that change: each sample whole and in order, from six copies, not fifteen."""
    from sglang.srt.hidden_states_dump.staged_answers import StagedAnswerRows

    dumper = start_dumper(dump_dir, LAYERS)
    dumper._staged = StagedAnswerRows(capacity=3)
    prompts = {"a": prompt(100, 4), "b": prompt(200, 3), "d": prompt(400, 2)}
    answers = {rid: [1000 + 100 * i + j for j in range(5)] for i, rid in enumerate(prompts)}
    run_forward(dumper, [(DumpRequest(rid, len(p), answer=True), p, 0) for rid, p in prompts.items()])
    copies = count_copies(dumper)

    def step(i, rids):
        run_decode(dumper, [answers[rid][i] for rid in rids] + [555],
                   [DumpRequest(rid, len(prompts[rid]), answer=True, decoding=True) for rid in rids] + [None],
                   [len(prompts[rid]) + i for rid in rids] + [77])

    step(0, "abd")                                    # 3 staged
    step(1, "abd")                                    # they go (3); 3 staged
    c = prompt(300, 2)
    run_forward(dumper, [(DumpRequest("c", 2), c, 0)])  # the staged go first (3), then c (2)
    step(2, "dba")                                    # 3 staged
    dumper.finish_answer(finished_req("a", prompts["a"], answers["a"][:3] + [999]))  # they go (3)
    dumper._staged.capacity = 1
    step(3, "bd")                                     # 2 rows do not fit: they go alone (2)
    dumper._staged.capacity = 3
    step(4, "bd")                                     # 2 staged
    dumper.finish_answer(finished_req("b", prompts["b"], answers["b"] + [999]))  # they go (2)
    dumper.finish_answer(finished_req("d", prompts["d"], answers["d"] + [999]))  # nothing staged
    lines = {line["rid"]: line for line in wait_for_manifest(dump_dir, ["a", "b", "c", "d"])}
    assert_dumped(dump_dir, lines["a"], prompts["a"] + answers["a"][:3], LAYERS)
    for rid in "bd":
        assert_dumped(dump_dir, lines[rid], prompts[rid] + answers[rid], LAYERS)
    assert_dumped(dump_dir, lines["c"], c, LAYERS)
    assert copies == [3, 3, 2, 3, 2, 2], copies


@pytest.mark.parametrize("taken_at_finish", [True, False])
def test_a_finishing_answer_takes_its_staged_rows_first(dump_dir, monkeypatch, taken_at_finish):
    """The last steps of an answer are still staged when its request finishes; the finish sends
    them to the host before the sample is put together. The control leaves them staged: the
    sample misses its last rows and writes nothing."""
    dumper = start_dumper(dump_dir, LAYERS)
    a = prompt(100, 4)
    run_forward(dumper, [(DumpRequest("a", 4, answer=True), a, 0)])
    decode_answer(dumper, "a", 4, [900, 901, 902])
    if not taken_at_finish:
        monkeypatch.setattr(dumper._staged, "holds", lambda rid: False)
    dumper.finish_answer(finished_req("a", a, [900, 901, 902, 903]))
    if taken_at_finish:
        [line] = wait_for_manifest(dump_dir, ["a"])
        assert_dumped(dump_dir, line, a + [900, 901, 902], LAYERS)
    else:
        assert wait_for_stats(dumper, lambda s: s["discarded"] == 1)["files"] == 0
