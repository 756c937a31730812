"""Faults injected inside the server process, attached with --forward-hooks like the oracle.

`stall_writer`: a disk that stalls. While the gate file exists, the dump's writer thread
(with a writer process: the thread that sends it jobs) waits before writing the job it has
taken from its queue (all but the first `after` jobs) (it first creates
`<gate>.holding`, so a test knows the writer holds a job), and a submit that finds the
queue full first writes the request's id to `<gate>.full`, so a test knows the scheduler is
about to wait for room (under `block`) or drop it (under `drop`). With `hold_answers`, the
forward waits too once the writer holds its job, so the server answers nothing more while
its disk stalls.

`poison_rows`: a NaN in one dumped row of the requests whose rid starts with a prefix, put
into the dump's rows before it looks for non-finite ones (the forward stays finite).

`report_pid`: writes the scheduler's process id to a file, so a test can set that process's
limits, and its writer process's, from outside them (`resource.prlimit`), while it serves.

`fail_in_the_dump`: the dump's capture raises on one tensor-parallel rank: at its first call
(the warmup's forward), or at the first forward that holds a dumped request whose rid starts
with a prefix. It touches a marker file first, so a test knows when it fired.

The hooks themselves do nothing; the factories are the way into the scheduler process.
"""

import time
from pathlib import Path


def stall_writer(config):
    from sglang.srt.hidden_states_dump.writer import DumpWriter

    gate = Path(config["gate"])
    file_contents = DumpWriter.file_contents
    let_through = iter(range(config.get("after", 0)))

    def stalled_file_contents(self, job):
        if next(let_through, None) is not None:
            return file_contents(self, job)
        gate.with_name(gate.name + ".holding").touch()
        while gate.exists():
            time.sleep(0.01)
        return file_contents(self, job)

    submit = DumpWriter.submit

    def submit_noting_a_full_queue(self, request, chunks):
        if self.full():
            gate.with_name(gate.name + ".full").write_text(request.rid)
        return submit(self, request, chunks)

    DumpWriter.file_contents = stalled_file_contents
    DumpWriter.submit = submit_noting_a_full_queue
    if not config.get("hold_answers"):
        return lambda module, inputs, output: None
    holding = gate.with_name(gate.name + ".holding")

    def hold_the_forward(module, inputs, output):
        while holding.exists() and gate.exists():
            time.sleep(0.01)

    return hold_the_forward


def stall_writer_spec(gate: Path, after: int = 0, hold_answers: bool = False) -> str:
    import json

    return json.dumps([{"name": "stall_writer", "target_modules": ["model.norm"],
                        "hook_factory": "tests.server.fault_hooks:stall_writer",
                        "config": {"gate": str(gate), "after": after, "hold_answers": hold_answers}}])


def report_pid(config):
    import os

    Path(config["pid_file"]).write_text(str(os.getpid()))
    return lambda module, inputs, output: None


def report_pid_spec(pid_file: Path) -> str:
    import json

    return json.dumps([{"name": "report_pid", "target_modules": ["model.norm"],
                        "hook_factory": "tests.server.fault_hooks:report_pid", "config": {"pid_file": str(pid_file)}}])


def poison_rows(config):
    """A NaN in one captured row of each dumped request whose rid starts with `rid_prefix`,
    put into the dump's own rows after they are taken off the forward and before the dump
    looks for non-finite rows (the forward itself, and so serving, stays finite)."""
    from sglang.srt.hidden_states_dump.capture import HiddenStatesDumper

    prefix = config["rid_prefix"]
    rows_of = HiddenStatesDumper._rows

    def poisoned_rows(self, forward_batch, hidden_states, aux_hidden_states, spans, token_ids=None):
        rows = rows_of(self, forward_batch, hidden_states, aux_hidden_states, spans, token_ids)
        offset = 0
        for request, _, start, end in spans:
            if request.rid.startswith(prefix):
                rows["hidden_states"][offset + min(1, end - start - 1), 0, 0] = float("nan")
            offset += end - start
        return rows

    HiddenStatesDumper._rows = poisoned_rows
    return lambda module, inputs, output: None


def poison_rows_spec(rid_prefix: str) -> str:
    import json

    return json.dumps([{"name": "poison_rows", "target_modules": ["model.norm"],
                        "hook_factory": "tests.server.fault_hooks:poison_rows", "config": {"rid_prefix": rid_prefix}}])


def fail_in_the_dump(config):
    import torch.distributed as dist
    from sglang.srt.hidden_states_dump.capture import HiddenStatesDumper

    rank, prefix, marker = int(config["rank"]), config.get("rid_prefix"), Path(config["marker"])
    if not dist.is_initialized() or dist.get_rank() != rank:
        return lambda module, inputs, output: None
    capture = HiddenStatesDumper.capture

    def failing_capture(self, forward_batch, *args, **kwargs):
        requests = forward_batch.hidden_states_dump_requests or ()
        if prefix is None or any(r is not None and r.rid.startswith(prefix) for r in requests):
            marker.touch()
            raise RuntimeError(f"injected failure in the dump on rank {rank}")
        return capture(self, forward_batch, *args, **kwargs)

    HiddenStatesDumper.capture = failing_capture
    return lambda module, inputs, output: None


def fail_in_the_dump_spec(rank: int, marker: Path, rid_prefix=None) -> str:
    import json

    return json.dumps([{"name": "fail_in_the_dump", "target_modules": ["model.norm"],
                        "hook_factory": "tests.server.fault_hooks:fail_in_the_dump",
                        "config": {"rank": rank, "marker": str(marker), "rid_prefix": rid_prefix}}])
