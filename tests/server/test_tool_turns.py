"""Conversations with reasoning and tool calls, as agentic datasets hold them, reach the chat
template whole: an assistant turn's reasoning_content and tool_calls, a tool turn's
tool_call_id, the record's tools. The loss mask covers what the assistant wrote (its reasoning
and its calls), not the tool's answer nor the tool definitions; the negative controls: the same
conversation without its tools renders no definitions, and a call whose arguments are not a
JSON object rejects the record, naming the turn. Run with the server tests, which have the
tokenizer's runtime."""

import copy
import json

import pytest

from scripts.dumps.chat import ChatEncoder, load_tokenizer
from scripts.dumps.conversations import Record, Rejected, to_sample

# A template in the shape of Kimi-K2's: no {% generation %} markers (the loss mask is found by
# rendering turn by turn), tools declared up front, reasoning between think tags, calls in a
# section of their own, tool answers naming the call they answer.
KIMI_LIKE_TEMPLATE = (
    "{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}<|im_user|>user<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- elif message['role'] == 'tool' %}<|im_system|>tool<|im_middle|>## Return of "
    "{{ message['tool_call_id'] }}\n{{ message['content'] }}<|im_end|>"
    "{%- elif message['role'] == 'assistant' %}<|im_assistant|>assistant<|im_middle|>"
    "<think>{{ message.get('reasoning_content') or '' }}</think>{{ message['content'] }}"
    "{%- if message.get('tool_calls') %}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] %}<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{{ call['function']['arguments'] | tojson }}<|tool_call_end|>{%- endfor %}<|tool_calls_section_end|>"
    "{%- endif %}<|im_end|>"
    "{%- else %}{{ raise_exception('no role ' + message['role']) }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def agent_record(arguments='{"city": "Paris"}') -> dict:
    return {"id": "agent-1", "tools": TOOLS, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should ask the weather tool.",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                         "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ]}


@pytest.fixture(scope="module")
def encoder(model_l3):
    return ChatEncoder(load_tokenizer(model_l3), KIMI_LIKE_TEMPLATE, "assistant")


def split_by_mask(encoder, ids, mask):
    """(the text the loss covers, the text it does not), each span decoded on its own."""
    spans = {0: [], 1: []}
    start = 0
    for n in range(1, len(ids) + 1):
        if n == len(ids) or mask[n] != mask[start]:
            spans[mask[start]].append(encoder.tokenizer.decode(ids[start:n]))
            start = n
    return "".join(spans[1]), "".join(spans[0])


def test_a_sample_keeps_the_reasoning_the_calls_and_the_tools():
    sample = to_sample(Record(1, agent_record()), "agents")
    assert sample.tools == TOOLS
    call_turn, tool_turn = sample.messages[1], sample.messages[2]
    assert call_turn["reasoning_content"] == "I should ask the weather tool."
    assert call_turn["content"] == ""  # null content of a turn that only calls, as SGLang renders it
    assert call_turn["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert tool_turn == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "functions.get_weather:0"}


def test_the_loss_covers_the_reasoning_and_the_calls_not_the_tools_answer(encoder):
    sample = to_sample(Record(1, agent_record()), "agents")
    ids, mask = encoder.encode(sample.messages, sample.tools)
    in_loss, out_of_loss = split_by_mask(encoder, ids, mask)
    assert "I should ask the weather tool." in in_loss
    assert 'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>' in in_loss
    assert "It is sunny in Paris." in in_loss
    assert "sunny, 21 C" in out_of_loss and "sunny, 21 C" not in in_loss
    assert '"description": "The weather in a city now"' in out_of_loss  # the definitions reach the template
    # Arguments given as an object render as those given as JSON text.
    as_object = to_sample(Record(1, agent_record(arguments={"city": "Paris"})), "agents")
    assert encoder.encode(as_object.messages, as_object.tools) == (ids, mask)


def test_negative_control_without_tools_no_definition_is_rendered(encoder):
    sample = to_sample(Record(1, agent_record()), "agents")
    ids, _ = encoder.encode(sample.messages)
    assert "The weather in a city now" not in encoder.tokenizer.decode(ids)


@pytest.mark.parametrize("change, named", [
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="{not json"), "turn 1's tool call 0"),
    (lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="[1, 2]"), "turn 1's tool call 0"),
    (lambda r: r["messages"][1]["tool_calls"][0].pop("function"), "turn 1's tool call 0"),
    (lambda r: r["messages"][1].update(reasoning_content=["a list"]), "turn 1"),
    (lambda r: r.update(tools={"get_weather": {}}), "its tools"),
])
def test_malformed_turns_are_rejected_naming_what(change, named):
    record = copy.deepcopy(agent_record())
    change(record)
    with pytest.raises(Rejected) as rejected:
        to_sample(Record(3, record), "agents")
    assert rejected.value.kind == "unknown_shape" and named in rejected.value.reason, rejected.value.reason


def test_generation_prompt_carries_the_tools_and_the_turns_before(encoder):
    sample = to_sample(Record(1, agent_record()), "agents")
    prompt = encoder.tokenizer.decode(encoder.generation_prompt(sample.messages[:3], sample.tools))
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS)[:20])
    assert prompt.endswith("sunny, 21 C<|im_end|><|im_assistant|>assistant<|im_middle|>")


def test_the_parsers_without_regenerate_are_refused(tmp_path):
    from tests.server.test_generate import run_generate

    result = run_generate("--dataset", tmp_path / "none.jsonl", "--out", tmp_path / "out", "--server",
                          "http://127.0.0.1:9", "--tool-call-parser", "kimi_k2")
    assert result.returncode == 2 and "pass --regenerate" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
