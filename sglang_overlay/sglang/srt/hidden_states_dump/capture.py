"""Capture on the scheduler thread: the model hands each forward's states to
HiddenStatesDumper.capture, which takes the dumped requests' rows off the device without
blocking the forward, stitches chunked prefills, and submits whole prompts to the writer; a
request whose answer is dumped too is submitted when it finishes, its prompt's rows followed
by those of every decode step (staged on the device meanwhile: staged_answers).
"""

import json
import logging
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence

import torch

from sglang.srt.hidden_states_dump import lifecycle
from sglang.srt.hidden_states_dump.config import (
    DumpConfig,
    answer_graphs,
    check_dump_dir,
    data_parallel_rank,
)
from sglang.srt.hidden_states_dump.copier import Landing, RowsCopier
from sglang.srt.hidden_states_dump.eagle3_layers import (
    draft_layer_ids,
    eagle3_model_class,
)
from sglang.srt.hidden_states_dump.format import (
    DumpCounters,
    DumpTimings,
    file_metadata,
    manifest_name,
    quantized_file_rows_like,
)
from sglang.srt.hidden_states_dump.host_buffers import Chunk, HostBuffers
from sglang.srt.hidden_states_dump.requests import (
    DumpRequest,
    holds_dumped_request,
    on_answer_finished,
    set_streams_sliced_by_token,
)
from sglang.srt.hidden_states_dump.process_writer import ProcessDumpWriter
from sglang.srt.hidden_states_dump.staged_answers import StagedAnswerRows
from sglang.srt.hidden_states_dump.store_sink import StoreDumpWriter
from sglang.srt.hidden_states_dump.startup_checks import (
    check_patches,
    check_server_args,
    prefill_graphs_run_dumps_eagerly,
)
from sglang.srt.hidden_states_dump.writer import (
    DumpWriter,
    remove_stale_temp_files,
    repair_torn_manifest,
)
from sglang.version import __version__

logger = logging.getLogger(__name__)

# The dump's own revision within the series, bumped when what it writes or refuses changes.
SERIES_REVISION = 10
SERIES_VERSION = f"{__version__}-{SERIES_REVISION}"


@dataclass
class PartialPrompt:
    """A request whose prompt is prefilled in chunks: the chunks seen so far."""

    request: DumpRequest
    chunks: List[Chunk] = field(default_factory=list)
    num_tokens: int = 0


def server_args_and_ranks():
    """This process's server arguments and its (attention-TP rank, data-parallel rank,
    last pipeline stage?). The data-parallel rank is the attention-DP rank under DP
    attention, else the replica's rank under --dp-size (0 without). 0.5.23 serves them from
    sglang.srt.runtime_context (get_global_server_args is retired there); older releases
    from module-level getters and, for the replica's rank, from the scheduler process
    (set_data_parallel_rank, which a patch calls)."""
    try:
        from sglang.srt.runtime_context import get_parallel, get_server_args
    except ImportError:
        from sglang.srt.distributed import get_pp_group
        from sglang.srt.layers.dp_attention import (
            get_attention_dp_rank,
            get_attention_tp_rank,
        )
        from sglang.srt.server_args import get_global_server_args

        server_args = get_global_server_args()
        if server_args.enable_dp_attention:
            dp_rank = get_attention_dp_rank()
        else:
            dp_rank = data_parallel_rank() or 0
        return server_args, (get_attention_tp_rank(), dp_rank, get_pp_group().is_last_rank)
    server_args, parallel = get_server_args(), get_parallel()
    # The runtime context holds the replica's rank in a scheduler process and in a Ray
    # scheduler actor alike.
    if server_args.enable_dp_attention:
        dp_rank = parallel.attn_dp_rank
    else:
        dp_rank = parallel.dp_rank or 0
    return server_args, (parallel.attn_tp_rank, dp_rank, parallel.pp_group.is_last_rank)


def forward_rows_bytes(
    num_tokens: int, num_layers: int, hidden_size: int, itemsize: int, fp8: bool
) -> int:
    """Host bytes of one forward's rows for `num_tokens` prompt tokens: token ids, the
    captured layers and the final state (`itemsize` bytes a value), with fp8's scales."""
    scales = (num_layers + 1) * 4 if fp8 else 0
    return num_tokens * (8 + (num_layers + 1) * hidden_size * itemsize + scales)


class GraphRows:
    """Where a decode CUDA graph leaves the captured layers' rows and the final state: captured
    with a copy of them into these buffers, every replay refills their first rows, which the
    dump reads right after the replay (dump_replayed_decode). The buffers are taken when the
    first decode graph, the largest (SGLang captures them largest first), is captured, from
    its memory pool, and held for the server's life: (K + 1) x H values a row."""

    def __init__(self):
        self.hidden_states: Optional[torch.Tensor] = None
        self.aux_hidden_states = None  # as the model hands them: a packed tensor or a list

    def record(self, hidden_states: torch.Tensor, aux_hidden_states) -> None:
        rows = hidden_states.shape[0]
        packed = isinstance(aux_hidden_states, torch.Tensor)
        if self.hidden_states is None:
            self.hidden_states = torch.empty_like(hidden_states)
            self.aux_hidden_states = (
                torch.empty_like(aux_hidden_states) if packed else [torch.empty_like(a) for a in aux_hidden_states]
            )
        if rows > self.hidden_states.shape[0]:
            raise RuntimeError(
                f"hidden states dump: a decode CUDA graph of {rows} rows was captured after one of "
                f"{self.hidden_states.shape[0]}; the dump takes its buffers from the first, the largest"
            )
        self.hidden_states[:rows].copy_(hidden_states)
        if packed:
            self.aux_hidden_states[:rows].copy_(aux_hidden_states)
        else:
            for buffer, states in zip(self.aux_hidden_states, aux_hidden_states):
                buffer[:rows].copy_(states)

    def rows(self, num_rows: int):
        """The first `num_rows` rows a replay left: (final states, aux states as captured)."""
        aux = self.aux_hidden_states
        aux = aux[:num_rows] if isinstance(aux, torch.Tensor) else [a[:num_rows] for a in aux]
        return self.hidden_states[:num_rows], aux


def capturing_decode_graph(forward_batch, hidden_states: torch.Tensor) -> bool:
    return (
        hidden_states.is_cuda
        and torch.cuda.is_current_stream_capturing()
        and forward_batch.forward_mode.is_decode()
    )


# The dumper of this process that writes (None: none), which a replayed decode graph serves.
_replaying_dumper: Optional["HiddenStatesDumper"] = None


def dump_replayed_decode(forward_batch) -> None:
    """Called by the decode CUDA graph runner right after it replays a graph for
    `forward_batch`: where graphs serve the dumped answers (SGLANG_HS_DUMP_ANSWER_GRAPHS), the
    rows of the answers it dumps, from where the graph left them. A replay runs no Python in
    the model; without this, a step that carries a dumped answer runs eagerly
    (requests.decode_graph_misses_dump). Costs one check while no answer is dumped."""
    dumper = _replaying_dumper
    if dumper is None or not holds_dumped_request(forward_batch.hidden_states_dump_requests):
        return
    if not answer_graphs():
        return
    if dumper.graph_rows.hidden_states is None:
        raise RuntimeError("hidden states dump: a decode CUDA graph replayed that left no rows for the dump")
    hidden_states, aux_hidden_states = dumper.graph_rows.rows(forward_batch.batch_size)
    dumper.capture(forward_batch, hidden_states, aux_hidden_states, replayed=True)


def layers_captured_in(forward_batch, layers_to_capture):
    """The layers a forward captures. A batch of a server that dumps (the dump is then the
    only capturer: it refuses speculative decoding) captures them only where it dumps a
    request; decode steps and the prefills of requests not dumped capture nothing, as with
    dumping off. Every rank of an attention group holds the same batch, so they agree; a
    batch built for a CUDA graph's capture carries no requests, and captures."""
    requests = forward_batch.hidden_states_dump_requests
    if requests is None or holds_dumped_request(requests):
        return layers_to_capture
    return ()


class HiddenStatesDumper:
    """One per model replica. Every rank validates the configuration the same way; only
    the rank that writes for its data-parallel group copies rows and writes files."""

    def __init__(
        self,
        config: DumpConfig,
        metadata: Dict[str, str],
        is_writer: bool,
        dp_rank: int = 0,
        reserve_bytes: int = 0,
    ):
        self.config = config
        self.layer_ids: List[int] = json.loads(metadata["layer_ids"])
        shared = is_writer and config.writer_process
        self.host_buffers = HostBuffers(
            reserve_bytes if is_writer else 0, pin_memory=torch.cuda.is_available(), shared=shared
        )
        self._gather_stream = None  # the rows are gathered off the forward's stream
        self._copier: Optional[RowsCopier] = None  # and copied to the host in slices
        # The model appends aux hidden states as its layers run, i.e. by ascending id.
        self._aux_order = [sorted(self.layer_ids).index(i) for i in self.layer_ids]
        self.is_writer = is_writer
        self._partials: Dict[str, PartialPrompt] = {}
        self.graph_rows = GraphRows()  # where decode CUDA graphs leave their rows
        # Requests whose prompt is whole and whose answer is being decoded, by rid.
        self._answers: Dict[str, PartialPrompt] = {}
        self._staged = StagedAnswerRows()  # their decode steps' rows, until they go to the host
        self.writer: Optional[DumpWriter] = None  # on the rank that writes
        if not is_writer:
            return
        on_answer_finished(self.finish_answer)
        global _replaying_dumper
        _replaying_dumper = self
        manifest = manifest_name(dp_rank, config.writer_id)
        remove_stale_temp_files(config.dump_dir)
        repair_torn_manifest(os.path.join(config.dump_dir, manifest))
        writer_options = dict(
            queue_size=config.queue_size,
            on_full_queue=config.on_full_queue,
            threads=config.writer_threads,
            manifest_name=manifest,
        )
        if config.sink == "mooncake":
            self.writer = StoreDumpWriter(
                config, metadata, host_buffers=self.host_buffers, dp_rank=dp_rank, manifest_name=manifest
            )
        elif shared:
            self.writer = ProcessDumpWriter(
                config.dump_dir, metadata, host_buffers=self.host_buffers, **writer_options
            )
        else:
            self.writer = DumpWriter(config.dump_dir, metadata, **writer_options)
        lifecycle.register_writer(self.writer, config.drain_timeout_s)
        eager = (
            "; prefills with dumped requests run without prefill CUDA graphs"
            if prefill_graphs_run_dumps_eagerly()
            else ""
        )
        logger.info(
            f"hidden states dump on: dir={config.dump_dir} manifest={manifest} {sink_description(config)} "
            f"layers={self.layer_ids} (of L={metadata['num_layers']}) "
            f"requests={config.sample.description()} "
            f"answers={'all' if config.answers else 'asked'}"
            f"{' (decode graphs serve them)' if config.answer_graphs else ''} "
            f"encoding={metadata['encoding']} writer_threads={config.writer_threads} "
            f"writer_process={'on' if shared else 'off'} "
            f"host_memory_mb={self.host_buffers.reserve.numel() >> 20} "
            f"eagle3_draft_layer_ids={metadata['eagle3_draft_layer_ids']}{eager}"
        )

    @classmethod
    def from_env(cls, model_config) -> Optional["HiddenStatesDumper"]:
        """The model's dumper when SGLANG_HS_DUMP_DIR is set, after every check; a
        ValueError stops the server before any warmup runs."""
        config = DumpConfig.from_env()
        if config is None:
            return None
        server_args, (attn_tp_rank, dp_rank, last_pp_stage) = server_args_and_ranks()
        check_server_args(server_args)
        check_patches()
        # 0.5.9 has no such option: its tokenizer manager hands each output its own values.
        set_streams_sliced_by_token(getattr(server_args, "incremental_streaming_output", False))
        num_layers = model_config.num_hidden_layers
        layer_ids = config.layer_ids(num_layers)
        check_layers_for_layout(config, layer_ids, num_layers)
        check_dump_dir(config.dump_dir)
        # The model is being built under its own default dtype.
        metadata = file_metadata(
            layer_ids,
            num_layers,
            server_args.model_path,
            sglang_version=__version__,
            series_version=SERIES_VERSION,
            fp8=config.dtype == "fp8",
            model_dtype=torch.get_default_dtype(),
            eagle3_draft_layer_ids=draft_layer_ids(
                eagle3_model_class(), layer_ids, num_layers
            ),
            vocab_size=getattr(model_config, "vocab_size", None),
            request_sample=config.sample.recorded(),
        )
        is_writer = attn_tp_rank == 0 and last_pp_stage
        # Unless set, room for the rows of the largest prefill the server runs, once for
        # each writer thread, once filling and once queued.
        largest_prefill = max(
            server_args.max_prefill_tokens, server_args.chunked_prefill_size or 0
        )
        itemsize = {"fp8": 1, "bf16": 2, None: torch.get_default_dtype().itemsize}
        reserve_bytes = config.host_memory_mb << 20 or forward_rows_bytes(
            largest_prefill,
            len(layer_ids),
            model_config.hidden_size,
            itemsize[config.dtype],
            fp8=config.dtype == "fp8",
        ) * (config.writer_threads + 2)
        return cls(config, metadata, is_writer, dp_rank, reserve_bytes)

    def counters(self) -> Optional[DumpCounters]:
        """The counters of this replica's writer (None on ranks that do not write)."""
        return self.writer.counters() if self.writer else None

    def timings(self) -> Optional[DumpTimings]:
        return self.writer.timings() if self.writer else None

    def capture(
        self,
        forward_batch,
        hidden_states: torch.Tensor,
        aux_hidden_states: Optional[Sequence[torch.Tensor]],
        replayed: bool = False,
    ) -> None:
        """Take the dumped requests' rows of one forward; `replayed`: the states are the
        rows a decode CUDA graph left in `graph_rows` (dump_replayed_decode)."""
        if not self.is_writer:
            return
        if not replayed and capturing_decode_graph(forward_batch, hidden_states):
            # A decode graph being captured: where graphs serve the dumped answers, it
            # copies its rows where a replay leaves them.
            if answer_graphs():
                self.graph_rows.record(hidden_states, aux_hidden_states)
            return
        requests = forward_batch.hidden_states_dump_requests
        if not requests:  # dumping off, or a decode step of no answer dumped
            return
        started = time.perf_counter()
        decode = forward_batch.forward_mode.is_decode()
        spans, continuing = self._spans(forward_batch, requests, decode)
        if not decode:
            self._discard_abandoned(continuing)
        if not spans:
            return
        blocked = 0.0
        if not (decode and self._stage(forward_batch.input_ids, hidden_states, aux_hidden_states, spans)):
            # Rows staged earlier reach their requests first.
            blocked = self._take_staged()
            blocked += self._add_rows(forward_batch.input_ids, hidden_states, aux_hidden_states, spans, replayed)
        elapsed = time.perf_counter() - started
        self.writer.stats.add(seconds=dict(capture_ms=elapsed - blocked))

    def _add_rows(self, input_ids, hidden_states, aux_hidden_states, spans, on_forward_stream=False) -> float:
        """Copy the spans' rows to the host and add each to its request; returns the seconds
        the submits waited for the queue."""
        overflows = self.host_buffers.overflows
        rows = self._copy_to_host(input_ids, hidden_states, aux_hidden_states, spans, on_forward_stream)
        if self.host_buffers.overflows != overflows:
            self.writer.stats.add(host_overflows=1)
        offset, blocked = 0, 0.0
        for request, prefix_len, start, end in spans:
            chunk = Chunk(rows, offset, offset + end - start)
            offset += end - start
            blocked += self._add_chunk(request, prefix_len, chunk)
        return blocked

    def _stage(self, input_ids, hidden_states, aux_hidden_states, spans) -> bool:
        """Stage a decode step's answer rows (StagedAnswerRows), sending those staged before to
        the host first when they would not fit beside them; False when not staged."""
        if self._staged.stage(input_ids, hidden_states, aux_hidden_states, spans):
            return True
        self._take_staged()
        return self._staged.stage(input_ids, hidden_states, aux_hidden_states, spans)

    def _take_staged(self) -> float:
        """Send the staged answer rows to the host, gathered on the stream they were staged
        on, and add each to its request."""
        if not len(self._staged):
            return 0.0
        stream = self._staged.stream
        input_ids, hidden_states, aux_hidden_states, spans = self._staged.take()
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            return self._add_rows(input_ids, hidden_states, aux_hidden_states, spans, on_forward_stream=True)

    def _spans(self, forward_batch, requests, decode: bool):
        """(request, prefix_len, first row, end row) of each dumped request's rows in this
        forward (its prompt's, or a decoded token's), and the rids whose prompt it continues."""
        if decode:
            # One row a request, the token at its last position: an answer's. Only the
            # dumped requests are looked at (a batch holds few among many).
            seq_lens = forward_batch.seq_lens_cpu
            spans = [
                (request if request.decoding else replace(request, decoding=True), int(seq_lens[row]) - 1, row, row + 1)
                for row, request in enumerate(requests)
                if request is not None and request.answer
            ]
            return spans, set()
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        extend_lens = forward_batch.extend_seq_lens_cpu
        spans, continuing = [], set()
        start = 0
        for request, prefix_len, extend_len in zip(requests, prefix_lens, extend_lens):
            prompt_rows = 0
            if request is not None and not request.decoding:
                continuing.add(request.rid)
                prompt_rows = max(0, min(extend_len, request.prompt_len - prefix_len))
                if prompt_rows:
                    spans.append((request, prefix_len, start, start + prompt_rows))
            # Rows past the prompt are the answer's: also those of a request the batch was
            # built for before its prompt's first token was known (the overlap scheduler's
            # mixed batches).
            if request is not None and request.answer and prompt_rows < extend_len:
                decoding = request if request.decoding else replace(request, decoding=True)
                spans.append((decoding, prefix_len + prompt_rows, start + prompt_rows, start + extend_len))
            start += extend_len
        return spans, continuing

    def _discard_abandoned(self, continuing) -> None:
        # The scheduler puts a request that is being prefilled in chunks into every
        # next prefill batch until its prompt is done; one missing from this batch was
        # aborted or retracted, and its chunks are dropped.
        for rid in [rid for rid in self._partials if rid not in continuing]:
            partial = self._partials.pop(rid)
            logger.info(
                f"hidden states dump: request {rid!r} left after "
                f"{partial.num_tokens} of {partial.request.prompt_len} prompt tokens; "
                f"nothing written"
            )
            self.writer.stats.add(discarded=1)

    def _copy_to_host(self, input_ids, hidden_states, aux_hidden_states, spans, on_forward_stream=False):
        """The forward's rows in host rows that the copier fills behind the forward (in fp8
        it quantizes them first, off the scheduler thread)."""
        if self._copier is None:
            self._copier = RowsCopier(hidden_states.device)
        device_rows, gathered = self._gather(input_ids, hidden_states, aux_hidden_states, spans, on_forward_stream)
        fp8 = self.config.dtype == "fp8"
        layout = quantized_file_rows_like(device_rows) if fp8 else device_rows
        host_rows = self.host_buffers.rows(layout, ready=Landing())
        targets = {name: getattr(host_rows, name) for name in layout}
        self._copier.submit(device_rows, targets, gathered, host_rows.ready, fp8)
        return host_rows

    def _gather(self, input_ids, hidden_states, aux_hidden_states, spans, on_forward_stream=False):
        """The forward's rows (`_rows`) and, on a CUDA device, the event they are complete
        under: gathered there on a stream of their own, so the forward does not wait; with
        `on_forward_stream` (a replayed graph's rows, staged rows) on the current stream,
        before the next replay or step refills the buffers they are taken from."""
        if hidden_states.device.type != "cuda":
            rows = self._rows(input_ids, hidden_states, aux_hidden_states, spans)
            return with_finite_rows(rows), None
        if on_forward_stream:
            rows = with_finite_rows(self._rows(input_ids, hidden_states, aux_hidden_states, spans))
            gathered = torch.cuda.Event()
            gathered.record()
            return rows, gathered
        # Taken on the forward's stream, before the next forward can refill their buffer.
        token_ids = self._token_ids(input_ids, spans)
        stream = self._gather_stream_after(hidden_states, aux_hidden_states)
        with torch.cuda.stream(stream):
            rows = self._rows(input_ids, hidden_states, aux_hidden_states, spans, token_ids)
            rows = with_finite_rows(rows)
            gathered = torch.cuda.Event()
            gathered.record(stream)
        return rows, gathered

    def _gather_stream_after(self, hidden_states, aux_hidden_states):
        """The stream the rows are gathered on, after the forward's work so far; the states,
        made on the forward's stream, stay allocated until the work queued on it is done."""
        if self._gather_stream is None:
            self._gather_stream = torch.cuda.Stream()
        stream = self._gather_stream
        stream.wait_stream(torch.cuda.current_stream())
        inputs = [hidden_states]
        inputs += [aux_hidden_states] if isinstance(aux_hidden_states, torch.Tensor) else list(aux_hidden_states)
        for tensor in inputs:
            tensor.record_stream(stream)
        return stream

    def _rows(self, input_ids, hidden_states, aux_hidden_states, spans, token_ids=None):
        """The dumped requests' rows of this forward: token ids, captured layers [T, K, H]
        in the configured order, the final state, in bf16 when SGLANG_HS_DUMP_DTYPE says
        so (fp8 is quantized by the copier). Each is the dump's own tensor, never a view of
        the forward's: the copier reads them after the forward has gone on. `token_ids`:
        the ids when already taken."""
        if isinstance(aux_hidden_states, torch.Tensor):
            # Packed by upstream's AuxHiddenStatePacker (0.5.23): [T, K * H], by ascending id.
            layers = dumped_rows(aux_hidden_states, spans).unflatten(-1, (len(self._aux_order), -1))
            aux_rows = layers[:, self._aux_order]  # indexing with a list copies
        else:
            aux_rows = torch.stack(
                [dumped_rows(aux_hidden_states[j], spans) for j in self._aux_order], dim=1
            )
        rows = {
            "token_ids": self._token_ids(input_ids, spans) if token_ids is None else token_ids,
            "hidden_states": aux_rows,
            "last_hidden_state": dumped_rows(hidden_states, spans),
        }
        if self.config.dtype == "bf16":
            for name in ("hidden_states", "last_hidden_state"):
                rows[name] = rows[name].to(torch.bfloat16)
        last = rows["last_hidden_state"]
        if last.untyped_storage().data_ptr() == hidden_states.untyped_storage().data_ptr():
            rows["last_hidden_state"] = last.clone()  # still a view: neither cut nor converted
        return rows

    @staticmethod
    def _token_ids(input_ids, spans) -> torch.Tensor:
        """The dumped rows' token ids, copied: the next forward may refill the buffer
        they sit in (0.5.23 does, on the CPU)."""
        return dumped_rows(input_ids, spans).to(torch.int64, copy=True)

    def _add_chunk(self, request: DumpRequest, prefix_len: int, chunk: Chunk) -> float:
        """Add a chunk to its request and submit the request once its prompt is whole (or,
        when its answer is dumped too, keep it for its answer's rows); returns the seconds
        the submit waited for the queue."""
        if request.decoding:
            self._add_answer_rows(request, prefix_len, chunk)
            return 0.0
        partial = self._partials.pop(request.rid, None)
        if prefix_len == 0:
            partial = PartialPrompt(request)
        elif partial is None or partial.num_tokens != prefix_len:
            have = 0 if partial is None else partial.num_tokens
            logger.error(
                f"hidden states dump: request {request.rid!r} has no hidden states for "
                f"prompt positions {have}..{prefix_len}; nothing written"
            )
            self.writer.stats.add(errors=1)
            return 0.0
        partial.chunks.append(chunk)
        partial.num_tokens += chunk.end - chunk.start
        if partial.num_tokens >= request.prompt_len and request.answer:
            self._answers[request.rid] = partial
        elif partial.num_tokens >= request.prompt_len:
            return self.writer.submit(request, partial.chunks)
        else:
            self._partials[request.rid] = partial
        return 0.0

    def _add_answer_rows(self, request: DumpRequest, prefix_len: int, chunk: Chunk) -> None:
        partial = self._answers.get(request.rid)
        if partial is None:  # its prompt was not captured whole, or it has finished
            return
        if prefix_len != partial.num_tokens:
            del self._answers[request.rid]
            logger.error(
                f"hidden states dump: request {request.rid!r} has no hidden states for "
                f"positions {partial.num_tokens}..{prefix_len} of its answer; nothing written"
            )
            self.writer.stats.add(errors=1)
            return
        partial.chunks.append(chunk)
        partial.num_tokens += chunk.end - chunk.start

    def finish_answer(self, req) -> None:
        """Submit a finished request whose answer was dumped: its prompt's rows and its
        answer's, one row for each token fed back (origin_input_ids + output_ids[:-1]; the
        overlap scheduler's step past the finish is cut). A request that was aborted or
        retracted, or whose rows are missing, writes nothing."""
        if self._staged.holds(req.rid):
            self._take_staged()
        partial = self._answers.pop(req.rid, None)
        if partial is None:
            return
        token_ids = list(req.origin_input_ids) + list(req.output_ids[:-1])
        finish = req.finished_reason.to_json() if req.finished_reason is not None else {}
        why = None
        if finish.get("type") == "abort":
            why = "it was aborted"
        elif req.retraction_count:
            why = "it was retracted (its prefill again would place prompt rows among the answer's)"
        elif partial.num_tokens < len(token_ids):
            why = f"it has rows for {partial.num_tokens} of its {len(token_ids)} tokens"
        if why is not None:
            logger.info(f"hidden states dump: request {req.rid!r}: {why}; nothing written")
            self.writer.stats.add(discarded=1)
            return
        chunks = cut_rows(partial.chunks, len(token_ids))
        request = partial.request
        answer_tokens = len(token_ids) - request.prompt_len
        whole = DumpRequest(
            request.rid,
            len(token_ids),
            with_answer_in_loss(request.loss_mask_runs, answer_tokens),
            req,
            request.asked,
            answer=True,
            token_ids=tuple(token_ids),
            answer_tokens=answer_tokens,
        )
        self.writer.submit(whole, chunks)


def cut_rows(chunks: List[Chunk], num_rows: int) -> List[Chunk]:
    """The chunks cut to their first `num_rows` rows."""
    kept, left = [], num_rows
    for chunk in chunks:
        if left <= 0:
            break
        rows = min(left, chunk.end - chunk.start)
        kept.append(chunk if rows == chunk.end - chunk.start else Chunk(chunk.rows, chunk.start, chunk.start + rows))
        left -= rows
    return kept


def with_answer_in_loss(runs: Optional[Sequence[int]], answer_tokens: int) -> Optional[Sequence[int]]:
    """A prompt's loss mask runs (zeros, ones, ...; None: every token) with an answer of
    `answer_tokens` tokens after it, all in the loss."""
    if runs is None or not answer_tokens:
        return runs
    runs = list(runs) or [0]
    if len(runs) % 2 == 0:  # it ends with a run of ones
        runs[-1] += answer_tokens
    else:
        runs.append(answer_tokens)
    return tuple(runs)


def sink_description(config: DumpConfig) -> str:
    if config.sink != "mooncake":
        return "sink=files"
    return (
        f"sink=mooncake layout={config.store_layout} store_id={config.store_id} "
        f"master={config.mooncake.master_server_addr} protocol={config.mooncake.protocol}"
    )


def check_layers_for_layout(config: DumpConfig, layer_ids: List[int], num_layers: int) -> None:
    """SpecForge's layout holds the draft's input, the EAGLE-3 layers side by side as SGLang
    feeds them: in ascending order, and below L."""
    if config.sink != "mooncake" or config.store_layout != "specforge":
        return
    if layer_ids != sorted(layer_ids) or num_layers in layer_ids:
        raise ValueError(
            f"SGLANG_HS_DUMP_LAYERS={','.join(map(str, layer_ids))} with "
            f"SGLANG_HS_DUMP_SINK_LAYOUT=specforge: SpecForge's hidden_state is what the draft "
            f"is fed, the EAGLE-3 layers in ascending order and below L={num_layers}; for "
            f"layer L (speculators) use the hs-connectors layout."
        )


def with_finite_rows(rows: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The rows and `finite_rows` [T] bool: whether every value of each row (all its layers
    and its final state) is finite. One min-max reduction per state tensor where the rows
    are (NaN propagates through both, an infinity is one of them), no full-size temporary;
    the flags reach the host with the rows, by the same copy, so nothing waits for them."""
    finite = None
    for name in ("hidden_states", "last_hidden_state"):
        low, high = torch.aminmax(rows[name].flatten(1), dim=-1)
        flags = low.isfinite() & high.isfinite()
        finite = flags if finite is None else finite & flags
    return dict(rows, finite_rows=finite)


def dumped_rows(tensor: torch.Tensor, spans) -> torch.Tensor:
    """The rows of `tensor` the spans (request, prefix_len, start, end) cover, in order: a
    view when they are contiguous, else a new tensor."""
    if len(spans) == 1 or all(a[3] == b[2] for a, b in zip(spans, spans[1:])):
        return tensor[spans[0][2] : spans[-1][3]]
    return torch.cat([tensor[start:end] for _, _, start, end in spans])
