"""Before it sends anything, `generate` checks that each server renders a conversation into the
token ids this command renders it into: the dump is only worth what SGLang feeds the draft at
serving, and a server started with another chat template (its --chat-template), another
tokenizer, or a template that reads the fields SGLang's chat endpoint fills in differently,
would serve prompts other than the ones dumped.

Each probe conversation goes to the server's chat endpoint with one new token,
`return_prompt_token_ids` and custom_params {"hidden_states_dump": false} (a dumping server
answers it without dumping it); the ids the endpoint rendered must equal the command's
rendering with the generation prompt. Two probes: a plain chat, and one with reasoning, a tool
call, a tool's answer and tool definitions, where the command's template renders those (a
template without tools is not asked about them). A server whose chat endpoint renders nothing
(started with --skip-tokenizer-init, as the server this command starts itself is: it is sent
token ids) or returns no prompt ids is reported as not checked.
"""

import urllib.error
from typing import List, Optional, Tuple

from scripts.dump_format import DUMP_PARAM
from scripts.dumps.chat import PROBE, ChatEncoder
from scripts.dumps.conversations import Rejected
from scripts.toolchain.errors import ToolError

PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_PROBE = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "The weather tool knows.",
     "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"},
]


def check_servers_render_as(servers: List[Tuple[object, dict]], encoder: ChatEncoder) -> List[str]:
    """What was checked at each (client, its server info), one line each; raises ToolError
    naming the first token where a server's rendering differs."""
    if not encoder.template:
        return ["chat rendering: not checked (no chat template: plain text records only)"]
    probes = [("a chat", PROBE[:3], None, encoder.generation_prompt(PROBE[:3]))]
    tools_note = None
    try:
        probes.append(("a tool call", TOOL_PROBE, PROBE_TOOLS, encoder.generation_prompt(TOOL_PROBE, PROBE_TOOLS)))
    except Rejected as e:
        tools_note = f"tool calls not checked (this template does not render them: {e.reason})"
    lines = []
    for client, info in servers:
        if (info.get("server_args") or info).get("skip_tokenizer_init"):
            lines.append(f"chat rendering at {client.url}: not checked (the server runs without its tokenizer, "
                         f"--skip-tokenizer-init, so its chat endpoint renders nothing)")
            continue
        checked = []
        for name, messages, tools, expected in probes:
            served = served_prompt_ids(client, messages, tools)
            if served is None:
                checked.append(f"{name} not checked (its chat endpoint returns no prompt ids)")
                continue
            if served != expected:
                raise ToolError(f"{client.url} renders {name} into other token ids than this command does "
                                f"({first_difference(encoder, expected, served)}): the dump would not hold the "
                                f"prompts the server serves. Give this command the server's chat template "
                                f"(--chat-template) or start the server with this one, or pass "
                                f"--no-template-check to dump anyway.")
            checked.append(f"{name} renders alike")
        if tools_note:
            checked.append(tools_note)
        lines.append(f"chat rendering at {client.url}: {'; '.join(checked)}")
    return lines


def served_prompt_ids(client, messages: List[dict], tools: Optional[List[dict]]) -> Optional[List[int]]:
    body = {"messages": messages, "max_tokens": 1, "temperature": 0, "return_prompt_token_ids": True,
            "custom_params": {DUMP_PARAM: False}}
    if tools:
        body["tools"] = tools
    try:
        answer = client.post("/v1/chat/completions", body)
    except urllib.error.HTTPError as e:
        raise ToolError(f"{client.url}/v1/chat/completions refused the template check's probe (HTTP {e.code}): "
                        f"{e.read().decode('utf-8', 'replace')[:300]}; pass --no-template-check to dump anyway")
    choices = answer.get("choices") if isinstance(answer, dict) else None
    ids = choices[0].get("prompt_token_ids") if choices and isinstance(choices[0], dict) else None
    return list(ids) if isinstance(ids, list) else None


def first_difference(encoder: ChatEncoder, expected: List[int], served: List[int]) -> str:
    n = next((k for k, (a, b) in enumerate(zip(expected, served)) if a != b), min(len(expected), len(served)))
    context = encoder.tokenizer.decode(expected[max(0, n - 8):n])
    return (f"{len(expected)} tokens here, {len(served)} there; first difference at token {n}, after "
            f"{context!r}: {encoder.tokenizer.decode(expected[n:n + 8])!r} here, "
            f"{encoder.tokenizer.decode(served[n:n + 8])!r} there")
