"""The dump with its later stages left out, for the prefill benchmark's ablations: where a
dumping server's time goes when it is not on the scheduler thread.

Each factory is attached with --forward-hooks (the way into the scheduler process, as
tests/server/fault_hooks.py does) and replaces one stage of the dump in that process:

- `capture_skipped`: the model still captures its layers and hands them to the dump, which
  returns at once: what capturing the layers costs the forward.
- `rows_not_copied`: the dumped requests' rows are gathered (and converted to bf16 when
  asked) on the gather stream as the dump does, then dropped: the device-side work, without
  the copies to the host (and without fp8's quantization, which the copier does).
- `copied_not_written`: everything up to the writer threads, which wait for each copy and
  write nothing: the copies, without the files. It replaces the writer threads' stages, so
  its server runs them (SGLANG_HS_DUMP_WRITER_PROCESS=0, STAGE_ENV), not a writer process.
- `quantized_not_copied`: an fp8 dump (SGLANG_HS_DUMP_DTYPE=fp8) whose copier quantizes
  each forward's rows on its stream and waits for them, then copies nothing, and whose
  writer threads write nothing: what fp8's quantization costs the forwards.

The hooks themselves do nothing. A server with any of them lands no files; its round ends at
its last response.
"""

import json

STAGES = ("capture_skipped", "rows_not_copied", "copied_not_written", "quantized_not_copied")
# What a server with a stage left out needs in its environment.
STAGE_ENV = {"copied_not_written": {"SGLANG_HS_DUMP_WRITER_PROCESS": "0"},
             "quantized_not_copied": {"SGLANG_HS_DUMP_WRITER_PROCESS": "0", "SGLANG_HS_DUMP_DTYPE": "fp8"}}


def capture_skipped(config):
    from sglang.srt.hidden_states_dump.capture import HiddenStatesDumper

    HiddenStatesDumper.capture = lambda self, forward_batch, hidden_states, aux_hidden_states: None
    return lambda module, inputs, output: None


def rows_not_copied(config):
    from sglang.srt.hidden_states_dump.capture import HiddenStatesDumper

    def capture(self, forward_batch, hidden_states, aux_hidden_states):
        requests = forward_batch.hidden_states_dump_requests
        if requests is None or not self.is_writer:
            return
        spans, _ = self._spans(forward_batch, requests, forward_batch.forward_mode.is_decode())
        if spans:
            # Gathered as the dump gathers them, then dropped (on a GPU the rows, made on
            # the gather stream, are freed there).
            self._gather(forward_batch.input_ids, hidden_states, aux_hidden_states, spans)

    HiddenStatesDumper.capture = capture
    return lambda module, inputs, output: None


def copied_not_written(config):
    from sglang.srt.hidden_states_dump.writer import DumpWriter

    def write_file(self, job):
        for chunk in job.chunks:
            chunk.wait()
        return sum(chunk.end - chunk.start for chunk in job.chunks)

    def publish(self, num_tokens):
        self.stats.add(files=1, tokens=num_tokens)
        self.queue.task_done()

    DumpWriter.write_file = write_file
    DumpWriter._publish = publish
    return lambda module, inputs, output: None


def quantized_not_copied(config):
    import torch

    from sglang.srt.hidden_states_dump import fp8_rows
    from sglang.srt.hidden_states_dump.copier import RowsCopier
    from sglang.srt.hidden_states_dump.format import quantize_file_rows

    def copy(self, job, sliced):
        # The copier's work up to its first slice: the fp8 rows made on its stream, waited
        # for, then dropped instead of copied.
        on_device = self.stream is not None
        if on_device:
            self.stream.wait_event(job.gathered)
            with torch.cuda.stream(self.stream):
                quantize_file_rows(job.rows, fp8_rows.quantize_rows)
                sliced.record(self.stream)
            sliced.synchronize()
        else:
            quantize_file_rows(job.rows, fp8_rows.quantize_rows)

    RowsCopier._copy = copy
    copied_not_written(config)  # and the writer threads write nothing
    return lambda module, inputs, output: None


def forward_hooks_arg(stage: str) -> str:
    """The --forward-hooks value that leaves the dump's later stages out from `stage` on."""
    if stage not in STAGES:
        raise ValueError(f"unknown dump stage {stage!r}; known: {', '.join(STAGES)}")
    return json.dumps([{"name": stage, "target_modules": ["no module has this name"],
                        "hook_factory": f"scripts.bench.dump_stages:{stage}"}])
