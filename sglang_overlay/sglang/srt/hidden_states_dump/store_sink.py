"""The Mooncake sink, on the scheduler's side: the writer process's last step is a put into a
Mooncake store (store_process.py) instead of a file. Capture, copier, host buffers, fp8, the
queue with its back-pressure and drain, and the writer process stay the file sink's; what
a job sends differs: each tensor's rows where they lie in shared memory, the manifest
entry, and the loss mask the request gave.
"""

import dataclasses
import json
import os
import sys
from typing import Dict, List

from sglang.srt.hidden_states_dump import store_layouts
from sglang.srt.hidden_states_dump.config import DumpConfig
from sglang.srt.hidden_states_dump.format import dtype_name
from sglang.srt.hidden_states_dump.host_buffers import HostBuffers
from sglang.srt.hidden_states_dump.process_writer import ProcessDumpWriter
from sglang.srt.hidden_states_dump.writer import WriteJob, new_run_id

# The writer process's script, run by its path (importing it here would put its folder's
# modules on the scheduler's sys.path under their bare names).
STORE_PROCESS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_process.py")


class StoreDumpWriter(ProcessDumpWriter):
    """A ProcessDumpWriter whose writer process puts each sample in a Mooncake store, in
    the configured layout, and lists it in the control directory (the dump directory)."""

    def __init__(self, config: DumpConfig, metadata: Dict[str, str], *, host_buffers: HostBuffers,
                 dp_rank: int, manifest_name: str):
        self.settings = dict(
            dataclasses.asdict(config.mooncake),
            layout=config.store_layout,
            store_id=config.store_id,
            on_full_queue=config.on_full_queue,
            writer_id=config.writer_id,
            dp_rank=dp_rank,
        )
        # The writer process names samples by the run; DumpWriter's own starts after it.
        self.settings["run_id"] = run_id = new_run_id()
        super().__init__(config.dump_dir, metadata, host_buffers=host_buffers,
                         queue_size=config.queue_size, on_full_queue=config.on_full_queue,
                         threads=config.writer_threads, manifest_name=manifest_name)
        self.run_id = run_id

    def command(self, fd: int, dump_dir: str, manifest_name: str, threads: int) -> List[str]:
        """store_process.py as a script: the server's interpreter and site-packages (torch,
        mooncake, hs-connectors), not its environment's PYTHONPATH."""
        return [sys.executable, "-I", STORE_PROCESS_SCRIPT, str(fd), dump_dir, manifest_name,
                str(threads), str(os.getpid()), json.dumps(self.settings)]

    def location(self, job: WriteJob) -> dict:
        """The sample's id, and its keys or transfer manifest, from the job's shapes alone
        (its rows need not have landed); the writer process names it alike."""
        first = job.chunks[0]
        num_tokens = sum(chunk.end - chunk.start for chunk in job.chunks)
        tensors = {}
        for name in first.rows.names():
            rows = first.take(name)
            tensors[name] = (dtype_name(rows.dtype), (num_tokens, *rows.shape[1:]))
        sample = store_layouts.sample_id(
            self.settings["writer_id"], self.settings["dp_rank"], self.run_id, job.sequence
        )
        return store_layouts.sample_location(
            self.settings["layout"], self.settings["store_id"], sample, tensors,
            json.loads(self.metadata["layer_ids"]),
        )

    def job_message(self, job: WriteJob, contents) -> tuple:
        tensors = [
            (
                name,
                dtype_name(chunks[0].dtype),
                [contents.num_tokens, *chunks[0].shape[1:]],
                [
                    (*self.host_buffers.segment_of(chunk), chunk.numel() * chunk.element_size())
                    for chunk in chunks if chunk.numel()
                ],
            )
            for name, chunks in contents.parts.items()
        ]
        entry = json.loads(contents.line)
        entry.update(encoding=self.metadata["encoding"], model_dtype=self.metadata.get("model_dtype"))
        return ("job", job.sequence, None, tensors, json.dumps(entry), job.request.loss_mask_runs)

