"""The target writes the answers (`generate --regenerate`): every assistant turn of each
conversation is written again by the served model, in order, each given the conversation as
regenerated so far, before anything is dumped. A draft then learns the target's own
distribution, not the one the dataset was written in.

Each turn is one /generate request: the conversation up to that turn rendered with the chat
template's generation prompt, sent as token ids, with the sampling options (temperature, top-p,
max new tokens) and a seed, and custom_params {"hidden_states_dump": false}, so that a dumping
server answers it without dumping it. The answer's token ids are decoded (special tokens left
out) and become the turn's text; user, system and tool turns stay as written. SGLang honors a
request's seed (`sampling_seed`) only on a server started with `--enable-deterministic-inference`;
each turn's seed is derived from the run's seed, the record's id and the turn's index, so a
rerun on such a server writes the same answers.

Reasoning and tool calls: with `--reasoning-parser NAME` and `--tool-call-parser NAME` (the
names of SGLang's own options, for the model served) each answer is asked for with its special
tokens kept, as SGLang's chat endpoint asks when tools are given, and split by the server's
own parsers (its /separate_reasoning and /parse_function_call endpoints, the code its chat
endpoint runs) into the fields the chat template renders: `reasoning_content`, `content` and
`tool_calls` ({"id", "type": "function", "function": {"name", "arguments"}}, the id as SGLang's
chat endpoint makes it: `functions.NAME:INDEX` for kimi_k2, else `call_` and a hash of the
record's id, turn and call, stable across runs). Tool calls are parsed only for records that
define `tools`, which the regenerated record keeps. Without the parsers an answer is its text,
special tokens left out: a reasoning model's thinking stays in its content, and tool-call
markers that are special tokens are lost.

A regenerated turn that calls other tools than the dataset's turn did (other names or
arguments, or calls where there were none, or none where there were some) makes the dataset's
later turns answer calls the target did not make: the conversation ends with that turn, its
record's `cut_after_turn` says where. Calls that match keep the dataset's ids, so its tool
turns still answer them.

A turn that stops at max new tokens is truncated: `--truncated keep` (the default) keeps it
and lists the turn in the record's `truncated_turns`, `--truncated reject` rejects the record.

Written into the dump folder, so that generate then dumps them and a rerun resumes:
- regenerated.jsonl: one record per conversation, {"id", "messages", "tools" (where the
  record has them), "regenerated": {the sampling options, seed, the parsers, source_line,
  truncated_turns, cut_after_turn}}, appended as conversations finish: a
  dataset generate takes back as it is. Plain text records pass through unchanged.
- regenerate_rejected.jsonl: the records not regenerated, {"line", "rid", "kind", "reason"},
  lines of the source dataset, each with its record's rid (null for a line that is no JSON
  object or whose id is unusable).
A rerun skips every record either file holds (a rejected one by its line and rid: a record
rejected as another's duplicate id does not stand for that other); a record whose requests
failed (every server unreachable) is in neither and is regenerated again.
"""

import hashlib
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from scripts.dump_format import DUMP_PARAM
from scripts.dumps.chat import ChatEncoder
from scripts.dumps.conversations import Rejected, Sample, read_samples, tool_call_arguments
from scripts.dumps.progress import progress_bar
from scripts.dumps.samples import AppendOnlyLines, read_lines
from scripts.toolchain.errors import USAGE, ToolError

REGENERATED_NAME = "regenerated.jsonl"
REGENERATE_REJECTED_NAME = "regenerate_rejected.jsonl"
TRUNCATED = ("keep", "reject")
RETRYABLE = (urllib.error.URLError, ConnectionError, TimeoutError, OSError)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    seed: int = 0

    def record(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": self.max_new_tokens,
                "seed": self.seed}

    def params(self, rid: str, turn: int) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": self.max_new_tokens,
                "sampling_seed": turn_seed(self.seed, rid, turn), "custom_params": {DUMP_PARAM: False}}


@dataclass(frozen=True)
class Parsers:
    """SGLang's parsers of the served model's answers, named as for the server's
    --reasoning-parser and --tool-call-parser; None: not parsed."""
    reasoning: Optional[str] = None
    tool_call: Optional[str] = None

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.tool_call)

    def record(self) -> dict:
        return {"reasoning_parser": self.reasoning, "tool_call_parser": self.tool_call}


def tool_call_id(parser: Optional[str], rid: str, turn: int, name: str, index: int, calls_before: int) -> str:
    """A regenerated call's id, as SGLang's chat endpoint makes it for `parser`: for kimi_k2
    `functions.NAME:N`, N the parser's tool_index plus the calls earlier in the conversation
    (Kimi-K2's templates render it); else a hash in the shape of its `call_` ids, stable
    across runs (SGLang's are random)."""
    if parser == "kimi_k2":
        return f"functions.{name}:{calls_before + index}"
    return "call_" + hashlib.sha256(f"{rid}\0{turn}\0{index}".encode("utf-8")).hexdigest()[:24]


def calls_made(message: dict) -> list:
    """(name, arguments as an object) of each tool call of a turn, in order: what a later
    tool turn answers."""
    made = []
    for call in message.get("tool_calls") or ():
        arguments = call["function"].get("arguments")
        try:
            arguments = tool_call_arguments(arguments)
        except ValueError:
            pass  # compared as written
        made.append((call["function"]["name"], arguments))
    return made


def turn_seed(seed: int, rid: str, turn: int) -> int:
    """A seed per turn, stable across runs and machines (not Python's salted hash)."""
    digest = hashlib.sha256(f"{seed}\0{rid}\0{turn}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class RegenerateTally:
    total: int = 0
    regenerated: int = 0
    already_done: int = 0
    turns: int = 0
    truncated_turns: int = 0
    cut: int = 0  # conversations that end early: a turn called other tools than the dataset's
    generated_tokens: int = 0
    rejected: Dict[str, int] = field(default_factory=dict)
    failed: int = 0
    failures: List[str] = field(default_factory=list)


class _Unreachable(Exception):
    pass


class Regeneration:
    """One pass over a dataset, conversations spread over `clients` (each with up to
    `concurrency` in flight), its results appended into `out`."""

    def __init__(self, clients: list, out: Path, encoder: ChatEncoder, sampling: Sampling,
                 truncated: str = "keep", concurrency: int = 8, retries: int = 3,
                 sleep: Callable[[float], None] = time.sleep, parsers: Parsers = Parsers()):
        if truncated not in TRUNCATED:
            raise ValueError(f"--truncated is one of {', '.join(TRUNCATED)}, not {truncated!r}")
        self.clients, self.out, self.encoder = clients, out, encoder
        self.sampling, self.truncated = sampling, truncated
        self.concurrency, self.retries, self.sleep = concurrency, retries, sleep
        self.parsers = parsers
        self.path = out / REGENERATED_NAME
        self.done = {entry["id"] for entry in read_lines(self.path)}
        rejected_before = read_lines(out / REGENERATE_REJECTED_NAME)
        self.rejected_records = {(entry["line"], entry["rid"]) for entry in rejected_before}
        self.rejected_lines = {entry["line"] for entry in rejected_before}
        self.tally = RegenerateTally()

    def run(self, dataset, limit: Optional[int]) -> RegenerateTally:
        self.tally.total = dataset.num_records if limit is None else min(limit, dataset.num_records)
        written = AppendOnlyLines(self.path)
        rejected = AppendOnlyLines(self.out / REGENERATE_REJECTED_NAME)
        bar = progress_bar(self.tally.total, desc="regenerate")
        try:
            with ThreadPoolExecutor(max_workers=self.concurrency * len(self.clients)) as pool:
                futures = {}
                for n, (record, result) in enumerate(read_samples(dataset, limit)):
                    if isinstance(result, Rejected):
                        self._reject(rejected, record.line, result.rid, result)
                        bar.update(1)
                        continue
                    if result.rid in self.done or (result.line, result.rid) in self.rejected_records:
                        self.tally.already_done += 1
                        bar.update(1)
                        continue
                    futures[pool.submit(self.conversation, result, n % len(self.clients))] = result
                for future in as_completed(futures):
                    sample = futures[future]
                    try:
                        record, generated = future.result()
                        written.append(record)
                        self._count(record, generated)
                    except Rejected as rejection:
                        self._reject(rejected, sample.line, sample.rid, rejection)
                    except _Unreachable as e:
                        self.tally.failed += 1
                        if len(self.tally.failures) < 20:
                            self.tally.failures.append(f"line {sample.line} ({sample.rid!r}): {e}")
                    bar.update(1)
        finally:
            bar.close()
            written.close()
            rejected.close()
        return self.tally

    def _reject(self, rejected: AppendOnlyLines, line: int, rid: Optional[str], rejection: Rejected) -> None:
        self.tally.rejected[rejection.kind] = self.tally.rejected.get(rejection.kind, 0) + 1
        if line not in self.rejected_lines:
            self.rejected_lines.add(line)
            rejected.append({"line": line, "rid": rid, "kind": rejection.kind, "reason": rejection.reason})

    def _count(self, record: dict, generated: int) -> None:
        """On the run's thread: the pool's threads only return their records."""
        self.tally.regenerated += 1
        self.tally.generated_tokens += generated
        if "messages" in record:
            self.tally.turns += sum(1 for m in record["messages"] if m["role"] == "assistant")
            self.tally.truncated_turns += len(record["regenerated"]["truncated_turns"])
            self.tally.cut += record["regenerated"]["cut_after_turn"] is not None

    def conversation(self, sample: Sample, first_client: int) -> Tuple[dict, int]:
        """The record of `sample` with every assistant turn written by the served model, and
        how many tokens the model wrote."""
        if sample.text is not None:
            return {"id": sample.rid, "text": sample.text}, 0
        messages, truncated_turns, generated, cut_after_turn = [], [], 0, None
        for turn, message in enumerate(sample.messages):
            if message["role"] != "assistant":
                messages.append(message)
                continue
            prompt = self.encoder.generation_prompt(messages, sample.tools)
            params = self.sampling.params(sample.rid, turn)
            if self.parsers:
                params["skip_special_tokens"] = False  # the parsers find the markers
            answer = self._post(first_client, {"input_ids": prompt, "rid": f"{sample.rid}#turn{turn}",
                                               "sampling_params": params})
            output_ids = answer.get("output_ids")
            if output_ids is None and not isinstance(answer.get("text"), str):
                raise Rejected("server", f"turn {turn}: the server's answer holds neither output_ids nor text")
            finish = (answer.get("meta_info") or {}).get("finish_reason") or {}
            if finish.get("type") == "length":
                if self.truncated == "reject":
                    raise Rejected("truncated", f"turn {turn} stopped at {self.sampling.max_new_tokens} new tokens "
                                                f"(--truncated reject)")
                truncated_turns.append(turn)
            generated += (answer.get("meta_info") or {}).get("completion_tokens", len(output_ids or []))
            if self.parsers:
                if not isinstance(answer.get("text"), str):
                    raise Rejected("server", f"turn {turn}: the server's answer holds no text for the parsers")
                regenerated = self._parsed(first_client, answer["text"], sample, turn, messages)
            else:
                text = self.encoder.decode(output_ids) if output_ids is not None else answer["text"]
                regenerated = {"role": "assistant", "content": text}
            same_calls = calls_made(regenerated) == calls_made(message)
            if same_calls and message.get("tool_calls"):
                for call, given in zip(regenerated["tool_calls"], message["tool_calls"]):
                    call["id"] = given.get("id", call["id"])  # the dataset's tool turns answer these ids
            messages.append(regenerated)
            if not same_calls and turn + 1 < len(sample.messages):
                cut_after_turn = turn
                break
        record = {"id": sample.rid, "messages": messages}
        if sample.tools:
            record["tools"] = sample.tools
        record["regenerated"] = {**self.sampling.record(), **self.parsers.record(), "source_line": sample.line,
                                 "truncated_turns": truncated_turns, "cut_after_turn": cut_after_turn}
        return record, generated

    def _parsed(self, first_client: int, text: str, sample: Sample, turn: int, messages: List[dict]) -> dict:
        """The assistant turn the server's own parsers find in an answer's text."""
        reasoning = None
        if self.parsers.reasoning:
            split = self._post(first_client, {"text": text, "reasoning_parser": self.parsers.reasoning},
                               "/separate_reasoning")
            reasoning, text = split.get("reasoning_text"), split.get("text")
            if not isinstance(text, str):
                raise Rejected("server", f"turn {turn}: /separate_reasoning answered no text")
        calls = []
        if self.parsers.tool_call and sample.tools:
            parsed = self._post(first_client, {"text": text, "tool_call_parser": self.parsers.tool_call,
                                               "tools": sample.tools}, "/parse_function_call")
            text, calls = parsed.get("normal_text"), parsed.get("calls")
            if not isinstance(text, str) or not isinstance(calls, list):
                raise Rejected("server", f"turn {turn}: /parse_function_call answered no normal_text and calls")
        message = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            before = sum(len(m.get("tool_calls") or ()) for m in messages)
            message["tool_calls"] = [
                {"id": tool_call_id(self.parsers.tool_call, sample.rid, turn, call["name"],
                                    call.get("tool_index", k) if self.parsers.tool_call == "kimi_k2" else k, before),
                 "type": "function", "function": {"name": call["name"], "arguments": call.get("parameters") or "{}"}}
                for k, call in enumerate(calls)]
        return message

    def _post(self, first_client: int, body: dict, path: str = "/generate") -> dict:
        """The answer of the first server, in turn from `first_client`, that gives one; a
        server's refusal (HTTP 4xx) rejects the record."""
        errors = []
        for k in range(len(self.clients)):
            client = self.clients[(first_client + k) % len(self.clients)]
            delay = 1.0
            for attempt in range(self.retries + 1):
                if attempt:
                    self.sleep(delay)
                    delay = min(delay * 2, 30.0)
                try:
                    answer = client.post(path, body)
                except urllib.error.HTTPError as e:
                    if 400 <= e.code < 500:
                        raise Rejected("server", f"the server refused a turn (HTTP {e.code}): "
                                                 f"{e.read().decode('utf-8', 'replace')[:500]}")
                    error = f"HTTP {e.code}"
                except RETRYABLE as e:
                    error = str(e) or type(e).__name__
                else:
                    finish = (answer.get("meta_info") or {}).get("finish_reason") or {}
                    if finish.get("type") != "abort":
                        return answer
                    error = f"the server aborted it: {finish.get('message')}"
            errors.append(f"{client.url}: {error}")
        raise _Unreachable(f"no server answered after {self.retries + 1} attempts each: {'; '.join(errors)}")


def check_parsers(clients: list, parsers: Parsers) -> None:
    """Every server runs the named parsers: each parses a probe text, or the run stops before
    it starts, naming the parser and the server."""
    probes = []
    if parsers.reasoning:
        probes.append(("--reasoning-parser", parsers.reasoning, "/separate_reasoning",
                       {"text": "probe", "reasoning_parser": parsers.reasoning}, "text"))
    if parsers.tool_call:
        tool = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}
        probes.append(("--tool-call-parser", parsers.tool_call, "/parse_function_call",
                       {"text": "probe", "tool_call_parser": parsers.tool_call, "tools": [tool]}, "normal_text"))
    for client in clients:
        for option, name, path, body, key in probes:
            try:
                answer = client.post(path, body)
            except urllib.error.HTTPError as e:
                raise ToolError(f"{option} {name}: {client.url}{path} refused it (HTTP {e.code}): "
                                f"{e.read().decode('utf-8', 'replace')[:300]}", USAGE)
            except RETRYABLE as e:
                raise ToolError(f"{option} {name}: {client.url}{path} did not answer ({e})")
            if not isinstance(answer, dict) or not isinstance(answer.get(key), str):
                raise ToolError(f"{option} {name}: {client.url}{path} answered without {key!r}: {str(answer)[:300]}")


def regenerated_metadata(out: Path) -> Dict[str, dict]:
    """rid -> its record's `regenerated` entry, for the samples lines."""
    return {entry["id"]: entry["regenerated"] for entry in read_lines(out / REGENERATED_NAME) if "regenerated" in entry}
