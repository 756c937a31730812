"""From a chat dataset to a finished hidden-states dump: chat template, loss masks, resume.

    python -m scripts.dumps.generate --dataset DATA --out DIR --model MODEL_DIR [options] [-- SERVER ARGS...]
    python -m scripts.dumps.generate --dataset DATA --out DIR --server http://HOST:PORT [--server ...] [--model MODEL_DIR] [options]

With --model alone it starts the patched SGLang server on the model (dumping into --out,
`--skip-tokenizer-init`, the arguments after `--` passed on), and stops it at the end; it
dies with this command. With --server it uses running servers, each of which must dump into
--out (SGLANG_HS_DUMP_DIR; several of them each with its own SGLANG_HS_DUMP_WRITER_ID); the
tokenizer comes from --model, else from the first server's model path. Each server gets up
to --concurrency requests in flight, so a faster one takes more samples.

Each valid sample (scripts/dumps/conversations.py) is tokenized with the model's chat
template and its loss mask found (scripts/dumps/chat.py), then sent as token ids with its
rid (its id, else `<dataset>:<line>`) for a one-token generation; the server dumps its
prompt. Once the dump's manifest lists the file, the sample gets its line in
DIR/samples.jsonl; records that are not samples go to DIR/rejected.jsonl with their line
and reason (scripts/dumps/samples.py).

With --regenerate the served model first writes every assistant turn again, into
DIR/regenerated.jsonl, and those conversations are what is dumped (scripts/dumps/regenerate.py).

Resume: run the same command again. Samples in samples.jsonl are skipped; a sample the
manifest lists but samples.jsonl does not (the command died between the two) gets its line
without being sent again; the rest are sent. Records already in rejected.jsonl are not
written there twice. Connection errors are retried with a doubling delay (--retries), then
the server is dropped and the samples it had not finished go to the other servers; with no
server left they count as failed. Exit status 0 when every valid sample is dumped, 1
otherwise, 2 for a usage error.
"""

import argparse
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Deque, Dict, List, Optional, Tuple

from scripts.dump_format import DUMP_PARAM, LOSS_MASK_PARAM, META_INFO_KEY, REF_CHANNEL, ManifestFollower, nonfinite_rows, sample_name
from scripts.dumps.chat import LOSS_MASKS, ChatEncoder, load_tokenizer
from scripts.dumps.conversations import Rejected, Sample, open_dataset, read_samples
from scripts.dumps.progress import human_bytes, progress_bar
from scripts.dumps.regenerate import (
    REGENERATE_REJECTED_NAME,
    REGENERATED_NAME,
    TRUNCATED,
    Parsers,
    RegenerateTally,
    Regeneration,
    Sampling,
    check_parsers,
    regenerated_metadata,
)
from scripts.dumps.samples import REJECTED_NAME, SAMPLES_NAME, AppendOnlyLines, read_lines, samples_line
from scripts.dumps.server import Server, has_gpu, runtime_env
from scripts.dumps.template_check import check_servers_render_as
from scripts.online.stream import CLOSED_MARKER, acknowledged_count
from scripts.dumps.samples import mask_runs
from scripts.toolchain.errors import USAGE, ToolError

SERVER_LOG = "server.log"
RETRYABLE = (urllib.error.URLError, ConnectionError, TimeoutError, OSError)


class Client:
    """JSON over HTTP to one SGLang server."""

    def __init__(self, url: str, timeout: float = 600):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())

    def server_info(self) -> dict:
        try:
            return self.get("/server_info")
        except urllib.error.HTTPError:
            return self.get("/get_server_info")


def model_of(info, url: str) -> Path:
    """The tokenizer's folder a running server names in its server info."""
    path = info.get("tokenizer_path") or info.get("model_path") if isinstance(info, dict) else None
    if not path:
        raise ToolError(f"--server {url}: its /server_info (or /get_server_info) names no model_path, "
                        f"so the tokenizer is unknown: pass --model")
    return Path(path)


class DumpingServer(Server):
    """The patched server on `model`, dumping into `out`, that dies with this command; on
    the CPU with SGLang's CPU path and the tests' memory sizes, then the user's arguments
    (later ones win)."""

    def __init__(self, model: Path, out: Path, layers: Optional[str], server_args: List[str], sink: str = "files",
                 sink_layout: Optional[str] = None, dtype: Optional[str] = None):
        dump_env = {"SGLANG_HS_DUMP_DIR": str(out)}
        if layers:
            dump_env["SGLANG_HS_DUMP_LAYERS"] = layers
        if dtype:
            dump_env["SGLANG_HS_DUMP_DTYPE"] = dtype
        if sink != "files":  # the MOONCAKE_* settings come from this command's environment
            dump_env["SGLANG_HS_DUMP_SINK"] = sink
        if sink_layout:
            dump_env["SGLANG_HS_DUMP_SINK_LAYOUT"] = sink_layout
        env = runtime_env(**dump_env) if "SGLANG_CHECKOUT" in os.environ else {**os.environ, **dump_env}
        super().__init__(model, out / SERVER_LOG, env, server_args, defaults=[] if has_gpu() else None,
                         cwd=None, tied_to_parent=True)


@dataclass(eq=False)
class Endpoint:
    """One server the samples are sent to, and what it did in this run."""
    client: Client
    server: Optional[DumpingServer] = None  # the one this command started
    in_flight: int = 0
    dumped: int = 0
    tokens: int = 0
    dropped: Optional[str] = None  # why no more samples go to it
    # Set from a sender thread: a sample ran out of retries on it, the rest would too.
    unreachable: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def label(self) -> str:
        return urllib.parse.urlsplit(self.url).netloc or self.url

    def gone(self) -> bool:
        return self.unreachable.is_set() or (self.server is not None and self.server.exited() is not None)


@dataclass
class Prepared:
    rid: str
    line: int
    input_ids: List[int]
    loss_mask: List[int]
    sent_to: Optional[Endpoint] = None  # the server it was last sent to
    posts: int = 0  # requests sent for it, to any server
    reported: Optional[str] = None  # the sample its last answer's meta_info named


@dataclass
class Tally:
    total: int = 0
    dumped: int = 0          # sent and dumped in this run
    completed: int = 0       # dumped by an earlier run, samples line written now
    already_done: int = 0    # in samples.jsonl before this run
    rejected: Counter = field(default_factory=Counter)
    rejected_before: int = 0  # of those, already in rejected.jsonl
    failed: int = 0
    not_attempted: int = 0
    tokens: int = 0          # prompt tokens dumped in this run
    bytes: int = 0           # their files' bytes
    nonfinite: List[str] = field(default_factory=list)  # rids of those with rows holding NaN or infinity
    failures: List[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.failed == 0 and self.not_attempted == 0


class Generation:
    """One run over a dataset: prepares samples and follows the manifests on this thread,
    sends them from a pool to whichever server has room. A sample gets its samples line once
    it is answered and a manifest lists its file (or at once, when an earlier run's manifest
    already does). A server that runs out of retries is dropped: its unfinished samples go
    to the others."""

    def __init__(self, endpoints: List[Endpoint], out: Path, encoder: ChatEncoder, max_tokens: Optional[int],
                 max_tokens_why: str, concurrency: int, retries: int, manifest_timeout: float,
                 max_unconsumed: Optional[int] = None, sample_extras: Optional[Dict[str, dict]] = None):
        self.endpoints, self.out, self.encoder = endpoints, out, encoder
        # rid -> what its samples line carries besides (with --regenerate: how it was regenerated)
        self.sample_extras = sample_extras or {}
        # With a store sink: samples the store may hold that no trainer has acknowledged.
        self.max_unconsumed = max_unconsumed
        self.max_tokens, self.max_tokens_why = max_tokens, max_tokens_why
        self.concurrency, self.retries, self.manifest_timeout = concurrency, retries, manifest_timeout
        self.done = {entry["rid"] for entry in read_lines(out / SAMPLES_NAME)}
        self.rejected_lines = {entry["line"] for entry in read_lines(out / REJECTED_NAME)}
        self.samples_file = AppendOnlyLines(out / SAMPLES_NAME)
        self.rejected_file = AppendOnlyLines(out / REJECTED_NAME)
        self.manifest = ManifestFollower(str(out))
        # Written on this thread only; the senders read it (a lookup) to spot a sample that
        # was dumped although its answer was lost with a broken connection.
        self.dumped: Dict[str, dict] = {}      # rid -> its first manifest entry
        self.waiting: Dict[str, Prepared] = {}  # answered, its manifest line not seen yet
        self.in_flight: Dict[Future, Prepared] = {}
        self.resend: Deque[Tuple[Prepared, str]] = deque()  # a dropped server's, with why
        self.last_answer = time.monotonic()
        self.tally = Tally()
        self.bar = None
        self.started = time.monotonic()

    # -- the manifest ------------------------------------------------------------------

    def _poll_manifest(self) -> None:
        for entry in self.manifest.poll():
            if entry["rid"] in self.dumped:
                continue
            self.dumped[entry["rid"]] = entry
            prepared = self.waiting.pop(entry["rid"], None)
            if prepared is not None:
                self._complete(prepared, entry, sent=True)

    # -- outcomes ------------------------------------------------------------------------

    def _complete(self, prepared: Prepared, entry: dict, sent: bool) -> None:
        if entry["num_tokens"] != len(prepared.input_ids):
            self._fail(prepared, f"the dump of {prepared.rid!r} has {entry['num_tokens']} tokens, the sample "
                                 f"{len(prepared.input_ids)}: was it dumped with another tokenizer or template?")
            return
        # One request, one answer: the sample its response named is the one its manifest lists.
        if sent and prepared.posts == 1 and prepared.reported != sample_name(entry):
            self._fail(prepared, f"the server's answer to {prepared.rid!r} named sample {prepared.reported!r}, "
                                 f"its manifest lists {sample_name(entry)!r}")
            return
        line = samples_line(prepared.rid, prepared.line, prepared.loss_mask, sample_name(entry))
        if prepared.rid in self.sample_extras:
            line["regenerated"] = self.sample_extras[prepared.rid]
        self.samples_file.append(line)
        self.done.add(prepared.rid)
        if nonfinite_rows(entry):
            self.tally.nonfinite.append(prepared.rid)
        if sent:
            self.tally.dumped += 1
            self.tally.tokens += entry["num_tokens"]
            prepared.sent_to.dumped += 1
            prepared.sent_to.tokens += entry["num_tokens"]
            if "bytes" in entry:  # in a store
                self.tally.bytes += entry["bytes"]
            else:
                try:
                    self.tally.bytes += os.path.getsize(self.out / entry["file"])
                except OSError:
                    pass
        else:
            self.tally.completed += 1
        self._advance()

    def _answered(self, prepared: Prepared) -> None:
        self.last_answer = time.monotonic()
        entry = self.dumped.get(prepared.rid)
        if entry is not None:
            self._complete(prepared, entry, sent=True)
        else:
            self.waiting[prepared.rid] = prepared

    def _reject(self, line: int, rid: Optional[str], rejection: Rejected) -> None:
        self.tally.rejected[rejection.kind] += 1
        if line in self.rejected_lines:
            self.tally.rejected_before += 1
        else:
            self.rejected_lines.add(line)
            self.rejected_file.append({"line": line, "rid": rid, "kind": rejection.kind, "reason": rejection.reason})
        self._advance()

    def _fail(self, prepared: Prepared, reason: str) -> None:
        self.tally.failed += 1
        if len(self.tally.failures) < 20:
            self.tally.failures.append(f"line {prepared.line} ({prepared.rid!r}): {reason}")
        self._advance()

    def _advance(self) -> None:
        if self.bar is None:
            return
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rejected = sum(self.tally.rejected.values())
        servers = "".join(f"; {e.label}{' (dropped)' if e.dropped else ''}: {e.dumped} at {e.tokens / elapsed:,.0f} tok/s"
                          for e in self.endpoints) if len(self.endpoints) > 1 else ""
        self.bar.set_postfix_str(f"{self.tally.tokens / elapsed:,.0f} prompt tok/s, {human_bytes(self.tally.bytes)}, "
                                 f"rejected {rejected}, failed {self.tally.failed}{servers}", refresh=False)
        self.bar.update(1)

    # -- sending (on the pool's threads: each returns its outcome) ------------------------

    def _live(self) -> List[Endpoint]:
        return [endpoint for endpoint in self.endpoints if endpoint.dropped is None and not endpoint.gone()]

    def _send(self, prepared: Prepared, endpoint: Endpoint) -> Optional[Rejected]:
        """None once the server answered (or any server dumped it); the Rejected the
        server's refusal makes; raises _Unanswered when every attempt failed."""
        # The loss mask rides along for a store's layout, which holds it with the rows; the
        # request asks for its dump, so a server that samples its traffic dumps it too.
        body = {"input_ids": prepared.input_ids, "rid": prepared.rid,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                    "custom_params": {LOSS_MASK_PARAM: mask_runs(prepared.loss_mask),
                                                      DUMP_PARAM: True}}}
        delay, error = 1.0, None
        for attempt in range(self.retries + 1):
            if prepared.rid in self.dumped:  # dumped, its answer lost with a broken connection
                return None
            if attempt:
                if endpoint.gone():
                    break
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
            try:
                prepared.posts += 1
                answer = endpoint.client.post("/generate", body)
            except urllib.error.HTTPError as e:
                if 400 <= e.code < 500:
                    message = e.read().decode("utf-8", "replace")[:500]
                    return Rejected("server", f"the server refused it (HTTP {e.code}): {message}")
                error = f"HTTP {e.code}"
                continue
            except RETRYABLE as e:
                error = str(e) or type(e).__name__
                continue
            meta_info = answer.get("meta_info") or {}
            finish = meta_info.get("finish_reason") or {}
            if finish.get("type") == "abort":
                error = f"the server aborted it: {finish.get('message')}"
                continue
            reported = meta_info.get(META_INFO_KEY) or [None]
            prepared.reported = sample_name(reported[0]) if reported[0] else None
            return None
        endpoint.unreachable.set()
        raise _Unanswered(f"not answered by {endpoint.url} after {self.retries + 1} attempts: {error}")

    def _collect(self, timeout: Optional[float]) -> None:
        """Wait up to `timeout` for a sent sample to finish, record every finished one, then
        read what the manifest gained."""
        if self.in_flight:
            finished, _ = wait(self.in_flight, timeout=timeout, return_when=FIRST_COMPLETED)
            for future in finished:
                prepared = self.in_flight.pop(future)
                prepared.sent_to.in_flight -= 1
                try:
                    refusal = future.result()
                except _Unanswered as e:
                    self._drop(prepared.sent_to, str(e))
                    self.resend.append((prepared, str(e)))
                    continue
                if refusal is not None:
                    self._reject(prepared.line, prepared.rid, refusal)
                else:
                    self._answered(prepared)
        self._poll_manifest()

    def _drop(self, endpoint: Endpoint, reason: str) -> None:
        """No more samples go to `endpoint`; those it answered that no manifest lists yet
        are sent again (its writer died with it, or they would be dumped twice)."""
        if endpoint.dropped is not None:
            return
        endpoint.dropped = reason
        self._poll_manifest()
        for rid, prepared in list(self.waiting.items()):
            if prepared.sent_to is endpoint:
                del self.waiting[rid]
                self.resend.append((prepared, f"answered by {endpoint.url}, which then stopped answering"))
        live = self._live()
        if live and self.bar is not None:
            self.bar.write(f"{endpoint.url} dropped ({reason}); its samples go to "
                           f"{', '.join(e.url for e in live)}", file=sys.stderr)

    def _submit(self, pool: ThreadPoolExecutor, prepared: Prepared, why_not: str) -> None:
        """Send `prepared` to the live server with the fewest requests in flight once one
        has room, or fail it with `why_not` when none is left."""
        while True:
            entry = self.dumped.get(prepared.rid)
            if entry is not None and prepared.sent_to is not None:  # dumped, its answer lost
                self._complete(prepared, entry, sent=True)
                return
            live = self._live()
            if not live:
                self._fail(prepared, why_not)
                return
            endpoint = min(live, key=lambda e: e.in_flight)
            if endpoint.in_flight < self.concurrency and not self._store_at_limit():
                break
            self._collect(timeout=0.05)
        prepared.sent_to = endpoint
        endpoint.in_flight += 1
        self.in_flight[pool.submit(self._send, prepared, endpoint)] = prepared

    def _store_at_limit(self) -> bool:
        """Whether the store holds --max-unconsumed samples no trainer has acknowledged
        (HiddenStatesStream's acknowledgement logs, or SpecForge's consumed count)."""
        if self.max_unconsumed is None:
            return False
        self._poll_manifest()
        consumed = max(acknowledged_count(self.out), specforge_consumed_count(self.out))
        return len(self.manifest.entries) - consumed >= self.max_unconsumed

    def _resend_dropped(self, pool: ThreadPoolExecutor) -> None:
        while self.resend:
            prepared, reason = self.resend.popleft()
            self._submit(pool, prepared, reason)

    def _prepare(self, sample: Sample) -> Prepared:
        if sample.text is not None:
            input_ids, loss_mask = self.encoder.encode_text(sample.text)
        else:
            input_ids, loss_mask = self.encoder.encode(sample.messages, sample.tools)
        if self.max_tokens is not None and len(input_ids) > self.max_tokens:
            raise Rejected("too_long", f"{len(input_ids)} tokens, more than {self.max_tokens} ({self.max_tokens_why})")
        if 1 not in loss_mask:
            raise Rejected("template", "no token of it is the assistant's")
        return Prepared(sample.rid, sample.line, input_ids, loss_mask)

    def run(self, dataset, limit: Optional[int]) -> Tally:
        self.tally.total = dataset.num_records if limit is None else min(limit, dataset.num_records)
        self._poll_manifest()
        self.bar = progress_bar(self.tally.total)
        resolved = 0
        with ThreadPoolExecutor(max_workers=self.concurrency * len(self.endpoints)) as pool:
            for record, result in read_samples(dataset, limit):
                self._resend_dropped(pool)
                if not self._live():
                    break
                resolved += 1
                if isinstance(result, Rejected):
                    self._reject(record.line, result.rid, result)
                    continue
                if result.rid in self.done:
                    self.tally.already_done += 1
                    self._advance()
                    continue
                try:
                    prepared = self._prepare(result)
                except Rejected as rejection:
                    self._reject(record.line, result.rid, rejection)
                    continue
                entry = self.dumped.get(prepared.rid)
                if entry is not None:
                    self._complete(prepared, entry, sent=False)
                    continue
                self._submit(pool, prepared, "every server is gone")
            while self.in_flight or self.resend:
                self._resend_dropped(pool)
                self._collect(timeout=0.05)
        self._wait_for_manifest()
        for prepared in self.waiting.values():
            self._fail(prepared, f"answered, but no file in the manifest of {self.out} after "
                                 f"{self.manifest_timeout:.0f} s: does the server dump there (SGLANG_HS_DUMP_DIR)?")
        self.waiting.clear()
        self.tally.not_attempted = self.tally.total - resolved
        self.bar.close()
        self.samples_file.close()
        self.rejected_file.close()
        return self.tally

    def _wait_for_manifest(self) -> None:
        """Every answered sample waits for its manifest line, up to --manifest-timeout after
        the last answer, or until the servers that answered them are gone."""
        while self.waiting and time.monotonic() - self.last_answer <= self.manifest_timeout:
            if all(prepared.sent_to.gone() for prepared in self.waiting.values()):
                self._poll_manifest()
                return
            time.sleep(0.005)
            self._poll_manifest()


def specforge_consumed_count(out: Path) -> int:
    """How many refs SpecForge's consumer reports consumed (StreamingRefChannel.mark_consumed)."""
    try:
        return int((out / f"{REF_CHANNEL}.consumed_count").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def close_store_channels(out: Path) -> None:
    """Tell the trainers no sample is to come: HiddenStatesStream's closed marker and
    SpecForge's channel sentinel (StreamingRefChannel.close)."""
    for marker in (out / CLOSED_MARKER, out / f"{REF_CHANNEL}.closed"):
        marker.touch()


class _Unanswered(Exception):
    """A sample every attempt of which failed."""


def report(tally: Tally, endpoints: List[Endpoint], out: Path, seconds: float, server_exit: Optional[int]) -> str:
    rejected = sum(tally.rejected.values())
    lines = [
        f"dumped {tally.dumped} samples in {seconds:.1f} s: {tally.tokens:,} prompt tokens "
        f"({tally.tokens / max(seconds, 1e-9):,.0f}/s), {human_bytes(tally.bytes)} written",
        *(f"  {e.url}: {e.dumped} samples, {e.tokens:,} prompt tokens ({e.tokens / max(seconds, 1e-9):,.0f}/s)"
          + (f"; dropped: {e.dropped}" if e.dropped else "") for e in (endpoints if len(endpoints) > 1 else [])),
        f"skipped as done: {tally.already_done}; completed from the manifest: {tally.completed}",
        f"rejected: {rejected}" + (f" ({', '.join(f'{kind} {n}' for kind, n in sorted(tally.rejected.items()))}; "
                                    f"{tally.rejected_before} recorded by an earlier run)" if rejected else ""),
        f"failed: {tally.failed}" + (f"; not attempted: {tally.not_attempted}" if tally.not_attempted else ""),
    ]
    if tally.nonfinite:
        lines.append(f"with rows that hold NaN or infinity (flagged in the manifest; the exports and the stream "
                     f"leave them out): {len(tally.nonfinite)}: {', '.join(map(repr, tally.nonfinite[:20]))}"
                     + (", ..." if len(tally.nonfinite) > 20 else ""))
    lines += [f"  {failure}" for failure in tally.failures]
    if server_exit is not None:
        lines.append(f"the server exited with code {server_exit} during the run; its log: {out / SERVER_LOG}")
    lines.append(f"{out}: {SAMPLES_NAME} (samples), {REJECTED_NAME} (rejected records with their reasons)")
    lines.append("every valid sample is dumped" if tally.complete else
                 "not every valid sample is dumped: run the same command again to finish")
    return "\n".join(lines)


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, required=True, help="JSON Lines, parquet, arrow or a saved dataset folder")
    parser.add_argument("--out", type=Path, required=True, help="the dump folder (manifest, files, samples.jsonl, rejected.jsonl)")
    parser.add_argument("--model", type=Path, help="the model folder (tokenizer, chat template); without --server, serve it")
    parser.add_argument("--server", action="append",
                        help="a running patched server dumping into --out, e.g. http://127.0.0.1:30000; "
                             "repeat it for several (each with its own SGLANG_HS_DUMP_WRITER_ID)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight per server (default 32)")
    parser.add_argument("--limit", type=int, help="only the first N records of the dataset")
    parser.add_argument("--max-length", type=int, help="reject samples of more tokens (default: what the server accepts)")
    parser.add_argument("--chat-template", type=Path, help="a Jinja chat template file (default: the model's own)")
    parser.add_argument("--loss-mask", choices=LOSS_MASKS, default="assistant",
                        help="assistant: the assistant's tokens (default); all: every token, for templates that allow no mask")
    parser.add_argument("--dump-layers", help="SGLANG_HS_DUMP_LAYERS of the server this command starts, e.g. 3,31,59")
    parser.add_argument("--dump-dtype", choices=("fp8",),
                        help="SGLANG_HS_DUMP_DTYPE of the server this command starts (default: the model's dtype)")
    parser.add_argument("--split", default="train", help="the split of a saved DatasetDict (default train)")
    parser.add_argument("--retries", type=int, default=5, help="retries of a request on connection errors (default 5)")
    parser.add_argument("--manifest-timeout", type=float, default=120.0,
                        help="seconds to wait after the last answer for the manifest to list every file (default 120)")
    parser.add_argument("--sink", choices=("files", "mooncake"), default="files",
                        help="where the server this command starts puts the rows: files in --out (default), or a "
                             "Mooncake store (MOONCAKE_* from this environment), --out holding only manifests")
    parser.add_argument("--sink-layout", choices=("specforge", "hs-connectors"),
                        help="with --sink mooncake: the trainers' layout (default specforge)")
    parser.add_argument("--max-unconsumed", type=int, default=256,
                        help="with --sink mooncake (or servers that put into a store): stop feeding while the store "
                             "holds this many samples no trainer has acknowledged (default 256)")
    parser.add_argument("--server-timeout", type=float, default=1800.0, help="seconds the started server has to get ready")
    parser.add_argument("--no-template-check", action="store_true",
                        help="dump even where a server's chat endpoint renders a conversation into other token ids "
                             "than this command does (scripts/dumps/template_check.py)")
    regenerate = parser.add_argument_group("--regenerate: the served model writes every assistant turn first "
                                           "(scripts/dumps/regenerate.py)")
    regenerate.add_argument("--regenerate", action="store_true",
                            help="regenerate each conversation's assistant turns with the served model, in order, "
                                 "into OUT/regenerated.jsonl, then dump those conversations")
    regenerate.add_argument("--temperature", type=float, default=0.7, help="the answers' temperature (default 0.7)")
    regenerate.add_argument("--top-p", type=float, default=1.0, help="the answers' top-p (default 1.0)")
    regenerate.add_argument("--max-new-tokens", type=int, default=2048, help="the longest answer (default 2048)")
    regenerate.add_argument("--seed", type=int, default=0,
                            help="the run's seed (default 0), each turn's derived from it; SGLang honors it on a "
                                 "server started with --enable-deterministic-inference")
    regenerate.add_argument("--reasoning-parser", metavar="NAME",
                            help="split each answer's reasoning into reasoning_content with SGLang's parser NAME "
                                 "(as for the server's --reasoning-parser), run by the server")
    regenerate.add_argument("--tool-call-parser", metavar="NAME",
                            help="parse each answer's tool calls into tool_calls with SGLang's parser NAME (as for "
                                 "the server's --tool-call-parser), run by the server, for records that define tools")
    regenerate.add_argument("--truncated", choices=TRUNCATED, default="keep",
                            help="an answer that stops at --max-new-tokens: keep it, listed in the record's "
                                 "truncated_turns (default), or reject the record")
    own, server_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    args.server_args = server_args
    if not args.model and not args.server:
        parser.error("pass --model (this command starts the server) or --server (a running one)")
    if args.server and (args.dump_layers or args.dump_dtype or server_args):
        parser.error("--dump-layers, --dump-dtype and server arguments apply to a server this command starts, "
                     "not to --server")
    if args.concurrency < 1 or (args.limit is not None and args.limit < 0) or (args.max_length is not None and args.max_length < 1):
        parser.error("--concurrency and --max-length are positive, --limit is not negative")
    if (args.reasoning_parser or args.tool_call_parser) and not args.regenerate:
        parser.error("--reasoning-parser and --tool-call-parser parse regenerated answers: pass --regenerate")
    if args.regenerate and not (args.temperature >= 0 and 0 < args.top_p <= 1 and args.max_new_tokens >= 1):
        parser.error("--temperature is not negative, --top-p is in (0, 1], --max-new-tokens is positive")
    return args


def generate(args: argparse.Namespace) -> int:
    dataset = open_dataset(args.dataset, args.split)
    template = None
    if args.chat_template:
        if not args.chat_template.is_file():
            raise ToolError(f"--chat-template {args.chat_template}: no such file", USAGE)
        template = args.chat_template.read_text(encoding="utf-8")
    if args.model and not (args.model / "config.json").is_file():
        raise ToolError(f"--model {args.model}: no config.json there (a Hugging Face model folder)", USAGE)
    args.out.mkdir(parents=True, exist_ok=True)
    server, server_exit = None, None
    try:
        infos = []
        for url in args.server or []:
            try:
                infos.append(Client(url).server_info())
            except RETRYABLE as e:
                raise ToolError(f"--server {url}: no answer ({e})")
        model = args.model or model_of(infos[0], args.server[0])
        encoder = ChatEncoder(load_tokenizer(model), template, args.loss_mask)
        if args.server:
            endpoints = [Endpoint(Client(url)) for url in args.server]
        else:
            server = DumpingServer(args.model, args.out, args.dump_layers, args.server_args, args.sink,
                                   args.sink_layout, args.dump_dtype).start()
            print(f"starting the server on {args.model} (log: {server.log_path}) ...", file=sys.stderr)
            server.wait_ready(args.server_timeout)
            endpoints = [Endpoint(Client(server.url), server)]
            infos.append(endpoints[0].client.server_info())
        max_tokens, why = args.max_length, "--max-length"
        server_limit = min((info.get("max_req_input_len") for info in infos if info.get("max_req_input_len")), default=None)
        if server_limit and (max_tokens is None or server_limit < max_tokens):
            max_tokens, why = server_limit, "the longest prompt every server accepts"
        if not args.no_template_check:
            for line in check_servers_render_as([(e.client, info) for e, info in zip(endpoints, infos)], encoder):
                print(line, file=sys.stderr)
        print(f"{dataset.path}: {dataset.num_records} records; loss mask: {encoder.method}; "
              f"longest prompt: {max_tokens} tokens", file=sys.stderr)
        started = time.monotonic()
        regenerated, limit = None, args.limit
        if args.regenerate:
            sampling = Sampling(args.temperature, args.top_p, args.max_new_tokens, args.seed)
            parsers = Parsers(args.reasoning_parser, args.tool_call_parser)
            clients = [e.client for e in endpoints]
            check_parsers(clients, parsers)
            regenerated = Regeneration(clients, args.out, encoder, sampling, args.truncated, args.concurrency,
                                       args.retries, parsers=parsers).run(dataset, args.limit)
            print(regenerate_report(regenerated, time.monotonic() - started), file=sys.stderr)
            dataset, limit = open_dataset(args.out / REGENERATED_NAME, args.split), None
        generation = Generation(endpoints, args.out, encoder, max_tokens, why, args.concurrency, args.retries,
                                args.manifest_timeout, args.max_unconsumed if args.sink == "mooncake" else None,
                                regenerated_metadata(args.out) if args.regenerate else None)
        tally = generation.run(dataset, limit)
        if args.sink == "mooncake" and tally.complete:
            close_store_channels(args.out)
        seconds = time.monotonic() - started
        server_exit = server.exited() if server is not None else None
    finally:
        if server is not None:
            server.stop()
    print(report(tally, endpoints, args.out, seconds, server_exit))
    if regenerated is not None and regenerated.failed:
        print(f"not every conversation is regenerated ({regenerated.failed} failed): run the same command again "
              f"to finish")
    return 0 if tally.complete and (regenerated is None or not regenerated.failed) else 1


def regenerate_report(tally: RegenerateTally, seconds: float) -> str:
    rejected = sum(tally.rejected.values())
    lines = [f"regenerated {tally.regenerated} conversations in {seconds:.1f} s: {tally.turns} assistant turns, "
             f"{tally.generated_tokens:,} tokens written by the model, {tally.truncated_turns} turns truncated, "
             f"{tally.cut} conversations ended where a turn called other tools than the dataset's",
             f"skipped as done: {tally.already_done}; rejected: {rejected}"
             + (f" ({', '.join(f'{kind} {n}' for kind, n in sorted(tally.rejected.items()))}, in "
                f"{REGENERATE_REJECTED_NAME})" if rejected else "")
             + f"; failed: {tally.failed}",
             *(f"  {failure}" for failure in tally.failures)]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return generate(args)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
