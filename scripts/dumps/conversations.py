"""Chat datasets in: JSON Lines in the two shapes people use, and the local files the
`datasets` library loads (parquet, arrow, a saved dataset folder); out: one sample per
record, or the reason it is not one.

    {"id": "a1", "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}
    {"id": "a2", "messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"id": "a3", "text": "..."}

Turns keep what a chat template renders besides the text, as OpenAI's chat API writes it: an
assistant turn's `reasoning_content` and `tool_calls` ([{"id", "type": "function",
"function": {"name", "arguments"}}], arguments a JSON string or an object; its content may then
be null), a tool turn's `tool_call_id` and `name`; the record's `tools` (OpenAI's tool
definitions, [{"type": "function", "function": {"name", ...}}]) go to the template as SGLang's
chat endpoint gives them. A shape other than these rejects the record, naming the turn.

A record with `text` and no turns is plain text, as a base model (no chat template) is trained
on: its sample is the text's tokens, every one of them in the loss.

Every record has a line: its line number in a JSON Lines file, its row number (from 1) in
a table. A sample's rid is its `id`, else `<dataset name>:<line>`.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from scripts.toolchain.errors import USAGE, ToolError

JSON_LINES_SUFFIXES = (".jsonl", ".json")
ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "model": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool",
}


class Rejected(Exception):
    """A record that is not a sample: `kind` (one word, for counting), why, and the rid it
    would have had (read_samples sets it; None where the record gives none: it is no JSON
    object, or its id is neither a string nor an integer)."""

    def __init__(self, kind: str, reason: str, rid: Optional[str] = None):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.rid = rid


@dataclass
class Record:
    line: int
    value: object = None
    rejection: Optional[Rejected] = None


@dataclass
class Sample:
    rid: str
    line: int
    messages: Optional[List[dict]]
    text: Optional[str] = None  # a plain text record's text (then messages is None)
    tools: Optional[List[dict]] = None  # the record's tool definitions, as it gives them


@dataclass
class Dataset:
    path: Path
    name: str
    num_records: int
    records: Iterator[Record]


def open_dataset(path: Path, split: str = "train") -> Dataset:
    """The dataset at `path`: JSON Lines (.jsonl, .json), parquet, arrow, or a folder written
    by `datasets`' save_to_disk. No hub access."""
    path = Path(path)
    if not path.exists():
        raise ToolError(f"{path}: no such file or folder", USAGE)
    name = path.name.split(".")[0] if path.is_file() else path.name
    if path.is_file() and path.suffix in JSON_LINES_SUFFIXES:
        with open(path, "rb") as f:
            count = sum(1 for line in f if line.strip())
        return Dataset(path, name, count, _json_lines(path))
    table = _load_table(path, split)
    return Dataset(path, name, len(table), (Record(n, row) for n, row in enumerate(table, start=1)))


def _json_lines(path: Path) -> Iterator[Record]:
    # Read as bytes: a line that is not UTF-8 is one bad record, not the end of the file.
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record(number, rejection=Rejected("not_utf8", f"not valid UTF-8 (byte {e.start} of the line)"))
                continue
            try:
                yield Record(number, json.loads(text))
            except ValueError as e:
                yield Record(number, rejection=Rejected("not_json", f"not JSON: {e}"))


def _load_table(path: Path, split: str):
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ToolError(f"{path} has the splits {sorted(loaded)}, not {split!r}; pass --split", USAGE)
                loaded = loaded[split]
            return loaded
        if path.suffix == ".parquet":
            return datasets.Dataset.from_parquet(str(path))
        if path.suffix == ".arrow":
            return datasets.Dataset.from_file(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ToolError(f"{path}: not a dataset the datasets library loads: {e}", USAGE)
    raise ToolError(f"{path}: not a dataset this command reads (JSON Lines .jsonl or .json, .parquet, "
                    f".arrow, or a folder written by datasets' save_to_disk)", USAGE)


def to_sample(record: Record, dataset_name: str) -> Sample:
    """The sample a record holds; raises Rejected when it holds none."""
    if record.rejection is not None:
        raise record.rejection
    value = record.value
    if not isinstance(value, dict):
        raise Rejected("unknown_shape", f"a JSON {type(value).__name__}, not an object with 'messages', 'conversations' or 'text'")
    rid = _rid(value, dataset_name, record.line)
    if "text" in value and not any(key in value for key in TURN_KEYS):
        text = value["text"]
        if not isinstance(text, str):
            raise Rejected("unknown_shape", f"'text' is a {type(text).__name__}, not a string")
        if not text.strip():
            raise Rejected("empty", "an empty text")
        _check_text(text, "its text")
        return Sample(rid, record.line, None, text)
    messages = [_message(turn, n) for n, turn in enumerate(_turns(value))]
    if not messages:
        raise Rejected("empty", "an empty conversation")
    if not any(m["role"] == "assistant" for m in messages):
        raise Rejected("no_assistant", "no assistant turn: nothing to train on")
    return Sample(rid, record.line, messages, tools=_tools(value.get("tools")))


def record_rid(record: Record, dataset_name: str) -> Optional[str]:
    """The rid a record's sample has, or would have had were it one (_rid); None for a record
    that is no JSON object or whose id is unusable."""
    if record.rejection is not None or not isinstance(record.value, dict):
        return None
    try:
        return _rid(record.value, dataset_name, record.line)
    except Rejected:
        return None


def _rid(value: dict, dataset_name: str, line: int) -> str:
    given = value.get("id")
    if given is None or given == "":
        return f"{dataset_name}:{line}"
    if isinstance(given, bool) or not isinstance(given, (str, int)):
        raise Rejected("unknown_shape", f"its id is a {type(given).__name__}, not a string or an integer")
    _check_text(str(given), "its id")
    return str(given)


TURN_KEYS = ("messages", "conversations")


def _turns(value: dict) -> list:
    for key in TURN_KEYS:
        if key in value:
            turns = value[key]
            if not isinstance(turns, list):
                raise Rejected("unknown_shape", f"'{key}' is a {type(turns).__name__}, not a list of turns")
            return turns
    raise Rejected("unknown_shape", f"no 'messages', 'conversations' or 'text' (keys: {', '.join(sorted(map(str, value))[:10])})")


def _message(turn, n: int) -> dict:
    """{"role", "content"} from an OpenAI ({"role", "content"}) or ShareGPT ({"from", "value"})
    turn, with the fields a template renders besides the text where the turn has them."""
    if not isinstance(turn, dict):
        raise Rejected("unknown_shape", f"turn {n} is a {type(turn).__name__}, not an object")
    role = turn.get("role", turn.get("from"))
    content = turn.get("content", turn.get("value"))
    if role not in ROLES:
        raise Rejected("unknown_shape", f"turn {n} has the role {role!r}; known: {', '.join(sorted(ROLES))}")
    role = ROLES[role]
    if isinstance(content, list):  # OpenAI content parts: text only
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise Rejected("unknown_shape", f"turn {n} has content parts other than text")
        content = "".join(part["text"] for part in content)
    message = {"role": role}
    if role == "assistant" and turn.get("tool_calls"):
        message["tool_calls"] = [_tool_call(call, n, k) for k, call in enumerate(_list(turn["tool_calls"], n, "tool_calls"))]
        if content is None:
            content = ""  # a turn that only calls tools: SGLang's chat endpoint renders null content as ""
    if not isinstance(content, str):
        raise Rejected("unknown_shape", f"turn {n} has no text content ({type(content).__name__})")
    _check_text(content, f"turn {n}")
    message["content"] = content
    extras = {"assistant": ("reasoning_content",), "tool": ("tool_call_id", "name")}.get(role, ())
    for key in extras:
        value = turn.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise Rejected("unknown_shape", f"turn {n}: its {key} is a {type(value).__name__}, not a string")
        _check_text(value, f"turn {n}'s {key}")
        message[key] = value
    return message


def _list(value, n: int, key: str) -> list:
    if not isinstance(value, list):
        raise Rejected("unknown_shape", f"turn {n}: its {key} is a {type(value).__name__}, not a list")
    return value


def _tool_call(call, n: int, k: int) -> dict:
    """An OpenAI tool call, checked: {"id"?, "type": "function", "function": {"name", "arguments"}}
    with arguments a JSON object or the JSON text of one, kept as given."""
    where = f"turn {n}'s tool call {k}"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise Rejected("unknown_shape", f"{where} is not {{\"function\": {{\"name\", \"arguments\"}}}}")
    arguments = function.get("arguments", {})
    try:
        parsed = tool_call_arguments(arguments)
    except ValueError as e:
        raise Rejected("unknown_shape", f"{where}: its arguments are not JSON ({e})")
    if not isinstance(parsed, dict):
        kind = "JSON " if isinstance(arguments, str) else ""
        raise Rejected("unknown_shape", f"{where}: its arguments are a {kind}{type(parsed).__name__}, not an object")
    _check_text(json.dumps(call, ensure_ascii=False), where)
    checked = {"type": call.get("type", "function"), "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        checked = {"id": str(call["id"]), **checked}
    return checked


def tool_call_arguments(arguments):
    """A tool call's arguments as the object they stand for: OpenAI's JSON text parsed (empty
    text: no arguments), an object as it is. ValueError for text that is not JSON."""
    if isinstance(arguments, str):
        return json.loads(arguments) if arguments.strip() else {}
    return arguments


def _tools(tools) -> Optional[List[dict]]:
    """The record's tool definitions: OpenAI's [{"type": "function", "function": {"name", ...}}]."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise Rejected("unknown_shape", f"its tools are a {type(tools).__name__}, not a list")
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise Rejected("unknown_shape", f"its tool {k} is not {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}")
    _check_text(json.dumps(tools, ensure_ascii=False), "its tools")
    return tools


def _check_text(text: str, where: str) -> None:
    # JSON can carry lone surrogates (\ud800) that no UTF-8 text holds.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Rejected("not_utf8", f"{where} is not valid UTF-8 text ({e.reason} at character {e.start})")


def read_samples(dataset: Dataset, limit: Optional[int] = None) -> Iterator[Tuple[Record, object]]:
    """(record, Sample or Rejected) for the first `limit` records; a second record with the
    rid of an earlier one is rejected. A rejection names the record's rid where it has one."""
    first_line = {}
    for count, record in enumerate(dataset.records):
        if limit is not None and count >= limit:
            return
        try:
            sample = to_sample(record, dataset.name)
        except Rejected as rejection:
            yield record, Rejected(rejection.kind, rejection.reason, record_rid(record, dataset.name))
            continue
        if sample.rid in first_line:
            yield record, Rejected("duplicate_id", f"the id {sample.rid!r} of line {first_line[sample.rid]} again",
                                   sample.rid)
            continue
        first_line[sample.rid] = record.line
        yield record, sample
