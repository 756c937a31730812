"""The dump's files written by a process of its own.

Every system call a writer thread makes gives up the interpreter lock, and taking it back
competes with the scheduler thread: inside a busy server four writer threads landed 4.5 GB/s
where the same threads alone land 10 (BENCHMARKS.md, "The writer process"). So the files are
written by a child process (files.py run as a script) that maps the host rows from shared
memory (HostBuffers(shared=True)). In the scheduler's process one thread sends each job
once its rows have landed, and one reads the answers; the queue, its back-pressure, the drain
and the counters are DumpWriter's, and the writer process keeps its file protocol and order.
"""

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Dict, List, Optional, Tuple

from sglang.srt.hidden_states_dump import files
from sglang.srt.hidden_states_dump.host_buffers import HostBuffers, SharedSegment
from sglang.srt.hidden_states_dump.writer import DumpWriter, WriteJob

logger = logging.getLogger(__name__)

# How long a writer process may take to answer that it can take jobs (a store sink
# connects to its store first).
WRITER_PROCESS_START_TIMEOUT_S = 120.0


class ProcessDumpWriter(DumpWriter):
    """A DumpWriter whose `threads` writer threads run in a writer process. At most twice
    that many jobs are in the writer process at once, so that a job waits in the queue,
    where back-pressure and the drain see it, as it does with writer threads."""

    def __init__(self, dump_dir: str, metadata: Dict[str, str], *, host_buffers: HostBuffers,
                 queue_size: int, on_full_queue: str, threads: int, manifest_name: str):
        if not host_buffers.shared:
            raise ValueError("a writer process reads the rows from shared host memory")
        self.host_buffers = host_buffers
        self._room = threading.Semaphore(2 * threads)
        # Jobs in the writer process by sequence, holding their host rows until answered.
        self._in_flight: Dict[int, Tuple[WriteJob, int, float]] = {}
        self._lock = threading.Lock()
        self._gone: Optional[str] = None  # why the writer process is gone
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Answered by the writer process once it can take jobs (a store sink: connected).
        self._ready: "Future[None]" = Future()
        command = self.command(theirs.fileno(), dump_dir, manifest_name, threads)
        # The answers thread starts the writer process: Linux sends the parent-death signal
        # when the *thread* that started a child ends, and this one lives as long as the
        # writer process matters, where the thread building the dumper may end first.
        started: "Future[subprocess.Popen]" = Future()
        threading.Thread(target=self._read_answers, args=(command, theirs, started),
                         name="hidden-states-dump-answers", daemon=True).start()
        try:
            self.process = started.result()
            self._ready.result(WRITER_PROCESS_START_TIMEOUT_S)
        except BaseException as e:
            self._socket.close()
            if isinstance(e, TimeoutError):
                self.process.kill()
                raise ValueError(
                    f"hidden states dump: the writer process did not start within "
                    f"{WRITER_PROCESS_START_TIMEOUT_S:g} s"
                )
            raise
        host_buffers.on_segment = self._send_segment
        host_buffers.on_forget = lambda segment_id: self._send(("forget", segment_id))
        for segment in list(host_buffers.segments.values()):
            self._send_segment(segment)
        super().__init__(dump_dir, metadata, queue_size=queue_size, on_full_queue=on_full_queue,
                         threads=1, manifest_name=manifest_name)
        logger.info(f"hidden states dump: files written by writer process {self.process.pid}")

    def command(self, fd: int, dump_dir: str, manifest_name: str, threads: int) -> List[str]:
        """The writer process's command line: files.py as a script, on the standard
        library alone and xxhash's compiled module, named by its file."""
        return [sys.executable, "-I", "-S", files.__file__, str(fd), dump_dir, manifest_name,
                str(threads), str(os.getpid()), files.xxhash_extension()]

    def job_message(self, job: WriteJob, contents) -> tuple:
        """What the writer process is sent for one job whose rows have landed."""
        parts = [contents.header] + [
            (*self.host_buffers.segment_of(tensor), tensor.numel() * tensor.element_size())
            for tensor in contents.tensors if tensor.numel()
        ]
        return ("job", job.sequence, contents.name, parts, contents.line)

    def stop(self, timeout: Optional[float] = None) -> None:
        """End the writer process once it has answered what it holds (call after drain);
        killed if it takes longer than `timeout` seconds."""
        try:
            self._socket.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # gone already
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            try:
                contents = self.file_contents(job)
                message = self.job_message(job, contents)
            except Exception as e:
                self._failed(job.request.rid, e)
                self._send(("skip", job.sequence))  # its turn passes
                self.queue.task_done()
                continue
            self._room.acquire()
            with self._lock:
                self._in_flight[job.sequence] = (job, contents.num_tokens, contents.copy_wait)
            del job, contents
            if not self._send(message):
                self._answered(("failed", message[1], self._gone or "the writer process is gone"))

    def _read_answers(self, command: List[str], theirs: socket.socket, started: Future) -> None:
        try:
            process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        except BaseException as e:
            started.set_exception(e)
            return
        finally:
            theirs.close()
        started.set_result(process)
        while True:
            try:
                data = self._socket.recvmsg(files.MAX_MESSAGE_BYTES)[0]
            except OSError:
                data = b""
            if not data:
                break
            self._answered(pickle.loads(data))
        code = process.wait()
        with self._lock:
            self._gone = f"the writer process exited (status {code})"
            sequences = list(self._in_flight)
        if not self._ready.done():
            self._ready.set_exception(ValueError(f"hidden states dump: {self._gone} before it started"))
        if sequences:
            logger.error(f"hidden states dump: {self._gone} with {len(sequences)} files unwritten")
        for sequence in sequences:
            self._answered(("failed", sequence, self._gone))

    def _answered(self, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            self._ready.set_result(None)
            return
        if kind == "unusable":
            self._ready.set_exception(ValueError(message[1]))
            return
        if kind == "store-full":  # a job waits for room in the store; answered later
            self.stats.add(store_full=1)
            return
        sequence = message[1]
        with self._lock:
            entry = self._in_flight.pop(sequence, None)
        if entry is None:
            return  # answered already: the writer process went while it was being sent
        job, num_tokens, copy_wait = entry
        rid = job.request.rid
        del job, entry  # its host rows go back
        if kind == "written":
            size, seconds = message[2:]
            self.stats.add(dict(seconds, copy_wait_ms=copy_wait), files=1, tokens=num_tokens, bytes=size)
        elif kind == "dropped":
            logger.warning(f"hidden states dump: dropped request {rid!r}: {message[2]}")
            self.stats.add(dropped=1)
        else:
            self._failed_as(rid, message[2])
        self._room.release()
        self.queue.task_done()

    def _send_segment(self, segment: SharedSegment) -> None:
        self._send(("segment", segment.id, segment.size), segment.fd)

    def _send(self, message: tuple, fd: Optional[int] = None) -> bool:
        """One message to the writer process; False when it is gone."""
        data = pickle.dumps(message)
        try:
            if fd is None:
                self._socket.sendall(data)
            else:
                socket.send_fds(self._socket, [data], [fd])
        except OSError as e:
            with self._lock:
                self._gone = self._gone or f"the writer process is gone ({e!r})"
            return False
        return True
