"""Dump files on disk: each written and fsynced under a temporary name, renamed once
complete, then listed with one manifest line, in submission order. So every manifest line
names a complete file, and a killed writer leaves at most one renamed file that no line
names.

Every file's manifest line carries the checksum of the bytes written (format.CHECKSUM_FIELD),
taken by XXH3-128 as they are written: 28 GB/s on one core of the writer's host, the interpreter
lock released (BENCHMARKS.md, "Checksums"), where hashlib's fastest, sha256, takes 1.75.

The standard library only, and xxhash's compiled module: run as a script, this module is the
writer process (`WriterProcess`), which writes the files of a server's dump outside the
scheduler's process, so that its system calls never take the interpreter lock from the
scheduler thread (BENCHMARKS.md, "The writer process"); it runs isolated from the server's
site-packages and loads that one module from the file the scheduler names.
"""

import contextlib
import fcntl
import importlib.util
import json
import mmap
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

# The most buffers one writev takes.
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
# Name prefix of files being written (format.TEMP_PREFIX, which imports torch).
TEMP_PREFIX = ".partial-"
# The checksum every manifest line carries (format.CHECKSUM_FIELD), "xxh3_128:<hex digest>".
CHECKSUM_FIELD = "checksum"
CHECKSUM_ALGORITHM = "xxh3_128"
_xxhash = None  # xxhash's compiled module, once loaded


def xxhash_extension() -> str:
    """The file of xxhash's compiled module, for a writer process that cannot import it."""
    import xxhash._xxhash

    return xxhash._xxhash.__file__


def load_xxhash(extension: Optional[str] = None):
    """xxhash's compiled module: imported, or loaded from `extension` (its file) in a process
    that runs on the standard library alone."""
    global _xxhash
    if _xxhash is None:
        if extension is None:
            import xxhash._xxhash as module
        else:
            spec = importlib.util.spec_from_file_location("_xxhash", extension)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        _xxhash = module
    return _xxhash


def checksum(buffers) -> str:
    """The checksum of `buffers`' bytes, back to back, as a manifest line carries it."""
    running = load_xxhash().xxh3_128()
    for buffer in buffers:
        running.update(buffer)
    return f"{CHECKSUM_ALGORITHM}:{running.hexdigest()}"


def with_checksum(line: str, value: str) -> str:
    """A manifest line with its sample's checksum."""
    entry = json.loads(line)
    entry[CHECKSUM_FIELD] = value
    return json.dumps(entry)


class InOrder:
    """Publishes the jobs that several threads take from one FIFO queue in the order they
    were submitted, without a thread waiting for the jobs before its own: each thread
    hands its finished job over and goes on, and the thread that hands over the job that
    is due publishes it and every handed-over job due after it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = 0  # the sequence due
        self._finished: Dict[int, Callable[[], None]] = {}
        self._publishing = False

    def finish(self, sequence: int, publish: Callable[[], None]) -> None:
        """Hand over job `sequence`: `publish` runs once every earlier job's has, on
        whichever thread gets there (this one, or one publishing already). It must not
        raise."""
        with self._lock:
            self._finished[sequence] = publish
            if self._publishing:
                return  # the publishing thread will reach it
            self._publishing = True
        while True:
            with self._lock:
                publish = self._finished.pop(self._next, None)
                if publish is None:
                    self._publishing = False
                    return
                self._next += 1
            publish()


def write_temp_file(dump_dir: str, name: str, buffers: List[memoryview]) -> Tuple[str, int, int, str]:
    """Write `buffers` back to back into a new temporary file for `name` and fsync it;
    returns (its path, its descriptor, open and locked until it is published, its size, the
    checksum of its bytes). The lock tells a writer starting on the same directory that the
    file is not stale."""
    value = checksum(buffers)
    temp_path = os.path.join(dump_dir, TEMP_PREFIX + name)
    fd = open_new_file(temp_path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = write_all(fd, buffers)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        remove_quietly(temp_path)
        raise
    return temp_path, fd, size, value


def publish_file(dump_dir: str, manifest_name: str, name: str, temp_path: str, line: str) -> None:
    """Rename a written file to `name` and append its manifest line; a failure leaves
    neither the file nor its line."""
    final_path = os.path.join(dump_dir, name)
    try:
        os.replace(temp_path, final_path)
    except BaseException:
        remove_quietly(temp_path)
        raise
    try:
        append_line(os.path.join(dump_dir, manifest_name), line)
    except BaseException:
        remove_quietly(final_path)
        raise


def open_new_file(path: str) -> int:
    """Create `path` for writing (it must not exist), and its directory if that is gone (a
    dump directory removed under a running server is made again)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, flags, 0o644)


def write_all(fd: int, buffers: List[memoryview]) -> int:
    """Write `buffers` back to back at the file's position with as few writev calls as the
    kernel takes (each at most IOV_MAX buffers; a short write resumes where it stopped);
    returns the bytes written."""
    pending = [memoryview(buffer).cast("B") for buffer in buffers]
    pending = [buffer for buffer in pending if len(buffer)]
    total = 0
    while pending:
        written = os.writev(fd, pending[:IOV_MAX])
        if written <= 0:
            raise OSError(f"writev wrote {written} bytes")
        total += written
        while pending and written >= len(pending[0]):
            written -= len(pending.pop(0))
        if written:
            pending[0] = pending[0][written:]
    return total


def append_line(path: str, line: str) -> None:
    """Append one line. The manifest is locked while the line is written: writers sharing
    it (servers given one writer id) append whole lines, and a writer starting on it repairs
    only a line no live writer is still appending (writer.repair_torn_manifest)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        append_to(fd, path, line)
    finally:
        os.close(fd)


def append_to(fd: int, path: str, line: str) -> None:
    """Append one line to `path`, open as `fd` (appending) and locked."""
    size = os.fstat(fd).st_size
    data = (line + "\n").encode("utf-8")
    try:
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {path}")
        os.fsync(fd)
    except BaseException:
        # A part of a line (a full disk) would join the next line appended.
        os.ftruncate(fd, size)
        raise


class LockedLines:
    """A JSON Lines file held under its lock (locked_lines)."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    def lines(self) -> List[dict]:
        return read_lines(self.path)

    def append(self, line: str) -> None:
        append_to(self.fd, self.path, line)


@contextlib.contextmanager
def locked_lines(path: str):
    """The JSON Lines file `path` (created if missing) under an exclusive lock, which
    append_line also takes, its torn last line cut first: a line a killed writer left half
    written would otherwise join the next one."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        torn = cut_torn_last_line(fd)
        if torn is not None:
            print(f"hidden states dump: removing a torn last line of {path}: {torn[:200]!r}", file=sys.stderr)
        yield LockedLines(fd, path)
    finally:
        os.close(fd)


def cut_torn_last_line(fd: int) -> Optional[bytes]:
    """Cut a torn last line (a writer killed, or the machine lost, in the middle of
    appending) of the JSON Lines file open as `fd` (appending, locked), so that the next line
    starts on a line of its own; a last line complete but for its newline gets it. Returns
    what was cut, if anything."""
    end = os.fstat(fd).st_size
    if end == 0 or os.pread(fd, 1, end - 1) == b"\n":
        return None
    start = end
    while start > 0:
        block_start = max(start - (1 << 16), 0)
        newline = os.pread(fd, start - block_start, block_start).rfind(b"\n")
        if newline >= 0:
            start = block_start + newline + 1
            break
        start = block_start
    tail = os.pread(fd, end - start, start)
    torn = json_line(tail) is None
    if torn:
        os.ftruncate(fd, start)
    else:
        os.write(fd, b"\n")  # complete but for its newline
    os.fsync(fd)
    return tail if torn else None


def json_line(raw: bytes) -> Optional[dict]:
    """A JSON Lines line's object; None for a torn or foreign line."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def read_lines(path: str) -> List[dict]:
    """The objects of a JSON Lines file, leaving out a torn line; none for a missing file."""
    try:
        with open(path, "rb") as f:
            return [parsed for parsed in map(json_line, f) if parsed is not None]
    except FileNotFoundError:
        return []


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


# The writer process's messages, pickled plain tuples, one per SOCK_SEQPACKET packet.
# To it: ("segment", id, size) with the segment's descriptor attached: shared memory that
# rows are read from; ("forget", id): no job to come reads that segment; ("job", sequence,
# name, [header bytes or (segment id, offset, length), ...], manifest line): a file; ("skip",
# sequence): a job that failed before it was sent, whose turn passes. From it:
# ("ready",) once, first: it takes jobs; or ("unusable", reason) and it exits (a store it
# cannot reach); then ("written", sequence, size, seconds), ("failed", sequence, error
# text) and ("dropped", sequence, why): a job dropped under `drop`, not an error.
MAX_MESSAGE_BYTES = 1 << 20
PR_SET_PDEATHSIG = 1


class WriterProcess:
    """Reads jobs from the scheduler's socket, writes them on `threads` threads and
    publishes them in their sequence's order, answering each. Ends once the socket is
    closed and every job taken is answered. Its sink is files; another sink (a store)
    overrides `take`, `write` and `publish`."""

    def __init__(self, sock: socket.socket, dump_dir: str, manifest_name: str, threads: int):
        self.sock = sock
        self.dump_dir = dump_dir
        self.manifest_name = manifest_name
        self.in_order = InOrder()
        self.jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self.segments: Dict[int, mmap.mmap] = {}
        self.threads = [threading.Thread(target=self._write, daemon=True) for _ in range(threads)]
        self._send_lock = threading.Lock()

    def run(self) -> None:
        for thread in self.threads:
            thread.start()
        while True:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE_BYTES, 1)
            if not data:
                break
            message = pickle.loads(data)
            kind = message[0]
            if kind == "segment":
                _, segment_id, size = message
                self.segments[segment_id] = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
                os.close(fds[0])
            elif kind == "forget":
                self.segments.pop(message[1], None)
            elif kind == "job":
                try:
                    job = self.take(message)
                except KeyError as e:
                    self._failed(message[1], f"no shared memory segment {e}")
                    continue
                self.jobs.put((message[1], job))
            elif kind == "skip":
                self.in_order.finish(message[1], lambda: None)
        for _ in self.threads:
            self.jobs.put(None)
        for thread in self.threads:
            thread.join()

    def view(self, part) -> memoryview:
        """The bytes a job's part names: (segment id, offset, length) in shared memory.
        Views are taken when the job arrives: a segment forgotten later stays mapped until
        they go."""
        segment_id, offset, length = part
        return memoryview(self.segments[segment_id])[offset : offset + length]

    def take(self, message: tuple):
        """A job message's work: ("job", sequence, name, [header bytes or (segment id,
        offset, length), ...], manifest line)."""
        _, _, name, parts, line = message
        return name, [part if isinstance(part, bytes) else self.view(part) for part in parts], line

    def write(self, job) -> tuple:
        """Write a job's file under its temporary name (on a writer thread)."""
        name, buffers, line = job
        temp_path, fd, size, value = write_temp_file(self.dump_dir, name, buffers)
        return name, temp_path, fd, size, with_checksum(line, value)

    def publish(self, written) -> int:
        """In the job's turn: rename its file and append its manifest line; its size."""
        name, temp_path, fd, size, line = written
        try:
            publish_file(self.dump_dir, self.manifest_name, name, temp_path, line)
        finally:
            os.close(fd)
        return size

    def _write(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            sequence, work = job
            started = time.perf_counter()
            try:
                written = self.write(work)
            except Exception as e:
                self.not_written(sequence, e)
                continue
            finally:
                del job, work
            write_ms = time.perf_counter() - started
            self.in_order.finish(sequence, partial(self._publish, sequence, written, write_ms))

    def not_written(self, sequence: int, error: Exception) -> None:
        """Answer a job whose write raised `error`; its turn passes."""
        self._failed(sequence, repr(error))

    def _failed(self, sequence: int, error: str, kind: str = "failed") -> None:
        """Answer that a job failed (or was dropped) before it was written; its turn passes."""
        self.answer((kind, sequence, error))
        self.in_order.finish(sequence, lambda: None)

    def _publish(self, sequence: int, written, write_ms: float) -> None:
        started = time.perf_counter()
        try:
            size = self.publish(written)
        except Exception as e:
            self.answer(("failed", sequence, repr(e)))
        else:
            seconds = dict(write_ms=write_ms, manifest_ms=time.perf_counter() - started)
            self.answer(("written", sequence, size, seconds))

    def answer(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self.sock.sendall(pickle.dumps(message))
            except OSError:
                pass  # the scheduler is gone: nobody to answer


def die_with_parent(parent_pid: int) -> None:
    """Be killed when the process that started this one dies (Linux), however it dies."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(0)  # it died before the line above


def main(argv: List[str]) -> int:
    """python files.py SOCKET_FD DUMP_DIR MANIFEST_NAME THREADS PARENT_PID XXHASH_EXTENSION"""
    fd, dump_dir, manifest_name, threads, parent_pid, extension = argv
    die_with_parent(int(parent_pid))
    load_xxhash(extension)
    # The server's signals are for the scheduler, which drains through this process and
    # then closes the socket: that is when this process ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    writer = WriterProcess(socket.socket(fileno=int(fd)), dump_dir, manifest_name, int(threads))
    writer.answer(("ready",))
    writer.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
