"""generate --regenerate on a real CPU server dumping: every assistant turn is written by the
served model, in order, each given the turns regenerated before it (checked by asking the server
again, turn by turn, outside the command); the regeneration's own requests are not dumped (the
manifest holds one file per record), while the negative control, a request that does not
decline, is; a private request is never dumped; the dump holds the regenerated conversations
with their loss masks over the model's answers; the samples lines say how they were made; a
rerun does nothing again; --truncated reject rejects what keep marks. Reasoning and tool calls:
the model's answers scripted in Kimi-K2's format (a tiny random model writes none), split by the
server's own parsers into the fields the template renders; a turn that calls other tools than
the dataset's ends the conversation there; a parser the server lacks stops the run first. The
server's chat endpoint renders a conversation as the command does, which the command checks
before it sends anything; another template is refused (the negative control)."""

import json
import random
import time

import pytest

from scripts.dump_format import load_dump, read_manifest
from scripts.dumps.chat import PROBE, ChatEncoder, load_tokenizer
from scripts.dumps.conversations import Record, to_sample
from scripts.dumps.generate import Client
from scripts.dumps.regenerate import (
    REGENERATE_REJECTED_NAME,
    REGENERATED_NAME,
    Parsers,
    Regeneration,
    Sampling,
    check_parsers,
)
from scripts.dumps.samples import SAMPLES_NAME, mask_from_runs, read_lines
from scripts.dumps.server import Server, runtime_env
from scripts.dumps.template_check import check_servers_render_as
from scripts.toolchain.errors import ToolError
from tests.server.test_generate import DUMP_LAYERS, conversation, expected_mask, run_generate
from tests.server.test_tool_turns import KIMI_LIKE_TEMPLATE, agent_record, split_by_mask

MAX_NEW_TOKENS = 12
CONVERSATIONS = 6


@pytest.fixture(scope="module")
def served(model_l3, tmp_path_factory):
    """One dumping server, the dataset, and a first --regenerate run over it."""
    tmp = tmp_path_factory.mktemp("regenerate")
    rng = random.Random(5)
    records = [dict(conversation(rng, n), id=f"conv-{n}") for n in range(CONVERSATIONS)]
    records.append({"id": "text-0", "text": "A plain text record passes through as it is."})
    dataset = tmp / "chats.jsonl"
    # Records that are rejected: without an answer (with an id and without), and another's id again.
    rejected = [{"messages": [{"role": "user", "content": "no answer"}]},
                {"id": "no-answer", "messages": [{"role": "user", "content": "no answer either"}]},
                dict(conversation(rng, 0), id="conv-0")]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in records + rejected))
    out = tmp / "dump"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_LAYERS=DUMP_LAYERS)
    # Every prompt prefilled whole and alone: the check below asks again for each answer, and on
    # the CPU a prefill over a cached prefix, or in another batch, may round differently.
    with Server(model_l3, tmp / "server.log", env, ["--disable-radix-cache", "--max-running-requests", "1"]) as server:
        server.wait_ready()
        options = ["--dataset", dataset, "--out", out, "--server", server.url, "--model", model_l3,
                   "--regenerate", "--temperature", 0, "--max-new-tokens", MAX_NEW_TOKENS, "--seed", 7,
                   "--concurrency", 1]
        first = run_generate(*options)
        assert first.returncode == 0, first.stdout + first.stderr
        yield {"server": server, "out": out, "records": records, "options": options, "first": first,
               "model": model_l3, "tmp": tmp}


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


def post(server, input_ids, **custom_params):
    return Client(server.url).post("/generate", {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "custom_params": custom_params}})


def assistant_texts(record: dict) -> list:
    turns = record.get("messages") or [{"role": t["from"], "content": t["value"]} for t in record["conversations"]]
    return [t["content"] for t in turns if t["role"] in ("assistant", "gpt")]


def test_each_turn_is_the_served_models_answer_given_the_turns_before(served):
    regenerated = {r["id"]: r for r in read_lines(served["out"] / REGENERATED_NAME)}
    assert sorted(regenerated) == sorted(r["id"] for r in served["records"])
    encoder = ChatEncoder(load_tokenizer(served["model"]))
    changed = 0
    for original in served["records"]:
        record = regenerated[original["id"]]
        if "text" in original:
            assert record == original
            continue
        context = []
        for turn, message in enumerate(record["messages"]):
            if message["role"] == "assistant":
                answer = post(served["server"], encoder.generation_prompt(context), hidden_states_dump=False)
                assert message["content"] == encoder.decode(answer["output_ids"]), (record["id"], turn)
            context.append(message)
        changed += assistant_texts(original) != [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        assert record["regenerated"]["temperature"] == 0 and record["regenerated"]["seed"] == 7
        assert record["regenerated"]["max_new_tokens"] == MAX_NEW_TOKENS
    assert changed == CONVERSATIONS  # a tiny random model writes none of the dataset's answers
    rejected = read_lines(served["out"] / REGENERATE_REJECTED_NAME)
    # Each names its record's rid: its id, else the dataset's name and the line.
    first = len(served["records"]) + 1
    assert [(r["line"], r["kind"], r["rid"]) for r in rejected] == [
        (first, "no_assistant", f"chats:{first}"), (first + 1, "no_assistant", "no-answer"),
        (first + 2, "duplicate_id", "conv-0")]


def test_only_the_regenerated_conversations_are_dumped_with_masks_over_the_answers(served):
    out = served["out"]
    manifest = read_manifest(str(out))
    samples = {s["rid"]: s for s in read_lines(out / SAMPLES_NAME)}
    assert len(manifest) == len(samples) == len(served["records"])  # no regeneration request dumped
    tokenizer = load_tokenizer(served["model"])
    regenerated = {r["id"]: r for r in read_lines(out / REGENERATED_NAME)}
    for entry in manifest:
        record = regenerated[entry["rid"]]
        input_ids = load_dump(str(out / entry["file"])).token_ids.tolist()
        mask = mask_from_runs(samples[entry["rid"]]["loss_mask"])
        if "text" in record:
            assert mask == [1] * len(input_ids) and "regenerated" not in samples[entry["rid"]]
            continue
        assert mask == expected_mask(tokenizer, record, input_ids)
        assert samples[entry["rid"]]["regenerated"] == record["regenerated"]


def test_a_request_that_does_not_decline_is_dumped_and_a_private_one_never(served):
    """The negative control of the test above, on the same server."""
    out = served["out"]
    before = len(read_manifest(str(out)))
    post(served["server"], [5, 6, 7, 8], private=True, hidden_states_dump=True)
    post(served["server"], [5, 6, 7, 9], hidden_states_dump=False)
    post(served["server"], [5, 6, 7, 10])
    wait_for(lambda: len(read_manifest(str(out))) > before, "the control request's manifest line")
    entries = read_manifest(str(out))
    assert len(entries) == before + 1
    assert load_dump(str(out / entries[-1]["file"])).token_ids.tolist() == [5, 6, 7, 10]


def test_a_rerun_regenerates_and_dumps_nothing_again(served):
    out = served["out"]
    lines_before = (out / REGENERATED_NAME).read_text()
    result = run_generate(*served["options"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "regenerated 0 conversations" in result.stderr
    assert f"skipped as done: {len(served['records'])}; rejected: 3" in result.stderr
    assert (out / REGENERATED_NAME).read_text() == lines_before
    assert "dumped 0 samples" in result.stdout


def test_truncated_answers_are_rejected_when_asked(served):
    kept = {r["id"]: r for r in read_lines(served["out"] / REGENERATED_NAME) if "messages" in r}
    truncated = {rid for rid, r in kept.items() if r["regenerated"]["truncated_turns"]}
    assert truncated  # a random model rarely ends an answer in 12 tokens
    out = served["tmp"] / "dump-reject"  # a server of the command's own dumps there
    options = [out if value == served["out"] else value for value in served["options"]]
    del options[options.index("--server"):options.index("--server") + 2]
    result = run_generate(*options, "--truncated", "reject", "--dump-layers", DUMP_LAYERS)
    assert result.returncode == 0, result.stdout + result.stderr
    rejected = {r["rid"] for r in read_lines(out / REGENERATE_REJECTED_NAME) if r["kind"] == "truncated"}
    assert rejected == truncated
    assert {r["id"] for r in read_lines(out / REGENERATED_NAME)} == {r["id"] for r in served["records"]} - truncated


PROBE_CHAT = PROBE[:3]
KIMI_PARSERS = Parsers(reasoning="kimi_k2", tool_call="kimi_k2")


def kimi_call(city: str) -> str:
    return ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            + json.dumps({"city": city}) + "<|tool_call_end|><|tool_calls_section_end|>")


class ScriptedAnswers:
    """The served model's answers, scripted per turn (rid#turnN -> text); everything else
    (the parsers' endpoints) goes to the real server."""

    def __init__(self, server, answers: dict):
        self.client, self.answers, self.generate_bodies = Client(server.url), answers, []
        self.url = server.url

    def post(self, path: str, body: dict) -> dict:
        if path != "/generate":
            return self.client.post(path, body)
        self.generate_bodies.append(body)
        text = self.answers[body["rid"]]
        return {"text": text, "meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": 9}}


def regenerate_agents(served, tmp_path, answers: dict, records: list, parsers=KIMI_PARSERS):
    encoder = ChatEncoder(load_tokenizer(served["model"]), KIMI_LIKE_TEMPLATE, "assistant")
    client = ScriptedAnswers(served["server"], answers)
    regeneration = Regeneration([client], tmp_path, encoder, Sampling(max_new_tokens=64), parsers=parsers)
    samples = [to_sample(Record(n + 1, record), "agents") for n, record in enumerate(records)]
    for sample in samples:
        record, _ = regeneration.conversation(sample, 0)
        yield sample, record, client, encoder


def test_reasoning_and_tool_calls_are_split_by_the_servers_parsers(served, tmp_path):
    answers = {"agent-1#turn1": "<think>Ask the tool.</think>Let me check." + kimi_call("Paris"),
               "agent-1#turn3": "<think>Easy.</think>Sunny, 21 C."}
    ((sample, record, client, encoder),) = regenerate_agents(served, tmp_path, answers, [agent_record()])
    calling, answering = record["messages"][1], record["messages"][3]
    assert calling["reasoning_content"] == "Ask the tool." and calling["content"] == "Let me check."
    (call,) = calling["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert call["id"] == "functions.get_weather:0"  # the dataset's id: its tool turn answers it
    assert record["messages"][2] == sample.messages[2]
    assert answering == {"role": "assistant", "content": "Sunny, 21 C.", "reasoning_content": "Easy."}
    assert record["tools"] == sample.tools
    assert record["regenerated"]["cut_after_turn"] is None
    assert record["regenerated"]["tool_call_parser"] == "kimi_k2"
    # Each turn was asked for with its special tokens kept, after the turns regenerated before it.
    first, second = client.generate_bodies
    assert first["sampling_params"]["skip_special_tokens"] is False
    assert first["input_ids"] == encoder.generation_prompt(sample.messages[:1], sample.tools)
    assert second["input_ids"] == encoder.generation_prompt(record["messages"][:3], sample.tools)
    # generate takes the record back: the loss covers the regenerated call.
    taken_back = to_sample(Record(1, record), "regenerated")
    in_loss, _ = split_by_mask(encoder, *encoder.encode(taken_back.messages, taken_back.tools))
    assert '{"city": "Paris"}<|tool_call_end|>' in in_loss and "Ask the tool." in in_loss


def test_a_turn_calling_other_tools_ends_the_conversation(served, tmp_path):
    answers = {"agent-1#turn1": "<think>Rome, surely.</think>" + kimi_call("Rome")}
    ((sample, record, _, _),) = regenerate_agents(served, tmp_path, answers, [agent_record()])
    assert record["regenerated"]["cut_after_turn"] == 1
    assert len(record["messages"]) == 2  # the dataset's tool answer was for Paris
    (call,) = record["messages"][1]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    assert call["id"] == "functions.get_weather:0"  # as SGLang's chat endpoint names Kimi-K2's calls
    # The negative control: an answer with no call where the dataset called one ends it too.
    answers = {"agent-1#turn1": "I cannot know the weather."}
    ((_, record, _, _),) = regenerate_agents(served, tmp_path, answers, [agent_record()])
    assert record["regenerated"]["cut_after_turn"] == 1 and "tool_calls" not in record["messages"][1]


def test_a_parser_the_server_lacks_stops_the_run_first(served):
    client = Client(served["server"].url)
    check_parsers([client], KIMI_PARSERS)
    with pytest.raises(ToolError, match="--tool-call-parser no_such_parser"):
        check_parsers([client], Parsers(tool_call="no_such_parser"))
    with pytest.raises(ToolError, match="--reasoning-parser no_such_parser"):
        check_parsers([client], Parsers(reasoning="no_such_parser"))


def test_the_servers_chat_rendering_is_checked_before_anything_is_sent(served, tmp_path):
    url = served["server"].url
    assert f"chat rendering at {url}: not checked (the server runs without its tokenizer" in served["first"].stderr
    out = tmp_path / "dump"
    env = runtime_env(SGLANG_HS_DUMP_DIR=str(out), SGLANG_HS_DUMP_LAYERS=DUMP_LAYERS)
    with Server(served["model"], tmp_path / "server.log", env, tokenizer=True) as server:
        server.wait_ready()
        client = Client(server.url)
        servers = [(client, client.server_info())]
        (line,) = check_servers_render_as(servers, ChatEncoder(load_tokenizer(served["model"])))
        assert line == f"chat rendering at {server.url}: a chat renders alike; tool calls not checked " \
                       f"(this template does not render them: the chat template refused it: no role tool in this chat template)"
        with pytest.raises(ToolError, match="renders a chat into other token ids than this command does"):
            check_servers_render_as(servers, ChatEncoder(load_tokenizer(served["model"]), KIMI_LIKE_TEMPLATE))
        template = tmp_path / "kimi-like.jinja"
        template.write_text(KIMI_LIKE_TEMPLATE)
        result = run_generate("--dataset", served["tmp"] / "chats.jsonl", "--out", out, "--server", server.url,
                              "--model", served["model"], "--chat-template", template)
        assert result.returncode != 0 and "renders a chat into other token ids" in result.stderr, result.stderr
        assert not (out / SAMPLES_NAME).exists()
        # The negative control of the probes, which ask not to be dumped: a request that does not ask.
        ids = ChatEncoder(load_tokenizer(served["model"])).generation_prompt(PROBE_CHAT)
        client.post("/generate", {"input_ids": ids, "rid": "control", "sampling_params": {"max_new_tokens": 1}})
    # The server has drained its dump on the way out: the control is all it wrote.
    assert [entry["rid"] for entry in read_manifest(out)] == ["control"]
