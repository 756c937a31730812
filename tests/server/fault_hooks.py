"""Faults injected inside the server process, attached with --forward-hooks like the oracle.

`stall_writer`: a disk that stalls. While the gate file exists, the dump's writer thread
waits before writing the job it has taken from its queue (it first creates
`<gate>.holding`, so a test knows the writer holds a job). The hook itself does nothing;
the factory is the way into the scheduler process.
"""

import time
from pathlib import Path


def stall_writer(config):
    from sglang.srt.hidden_states_dump.writer import DumpWriter

    gate = Path(config["gate"])
    write_file = DumpWriter.write_file

    def stalled_write_file(self, job):
        gate.with_name(gate.name + ".holding").touch()
        while gate.exists():
            time.sleep(0.01)
        return write_file(self, job)

    DumpWriter.write_file = stalled_write_file
    return lambda module, inputs, output: None


def stall_writer_spec(gate: Path) -> str:
    import json

    return json.dumps([{"name": "stall_writer", "target_modules": ["model.norm"],
                        "hook_factory": "tests.server.fault_hooks:stall_writer", "config": {"gate": str(gate)}}])
