"""Writing what is queued before a process goes.

Two ways out lead to the drain: SIGTERM (the server terminating its processes, see
drain_before_kill) and a scheduler's own return from its event loop (from 0.5.14 a
ShutdownReq ends it; the writer's daemon threads would end with the process). The
server's startup path installs both (drain_writers_at_exit) in each scheduler process,
once its model, and with it the dump's writer, is built.
"""

import logging
import multiprocessing.util
import os
import signal
import threading
from typing import List, Tuple

from sglang.srt.environ import envs
from sglang.srt.hidden_states_dump.config import dump_enabled
from sglang.srt.hidden_states_dump.writer import DumpWriter

logger = logging.getLogger(__name__)

# The writers of this process (one per model replica it holds), each with its drain
# timeout (SGLANG_HS_DUMP_DRAIN_TIMEOUT_S).
_writers: List[Tuple[DumpWriter, float]] = []


def register_writer(writer: DumpWriter, drain_timeout_s: float) -> None:
    _writers.append((writer, drain_timeout_s))


# The title SGLang gives each scheduler process (with a suffix naming its ranks).
SCHEDULER_TITLE = "sglang::scheduler"


def drain_before_kill(processes) -> None:
    """Called by the server before it kills its processes (SIGTERM, SIGINT, its own
    shutdown): asks them to terminate, which a writing scheduler does only once it has
    written what it holds, and waits for the schedulers at most
    SGLANG_HS_DUMP_DRAIN_TIMEOUT_S seconds. Only schedulers hold writers; the others are
    not waited for (multiprocessing's resource tracker ignores SIGTERM, and waiting for it
    held every shutdown for the whole timeout). The caller kills what is left."""
    if not dump_enabled() or not processes:
        return
    import psutil

    schedulers = []
    for process in processes:
        try:
            title = process.cmdline()[:1]
            process.terminate()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if title and title[0].startswith(SCHEDULER_TITLE):
            schedulers.append(process)
    # A little longer than the writer's own deadline, so that it can log what it lost.
    psutil.wait_procs(schedulers, timeout=envs.SGLANG_HS_DUMP_DRAIN_TIMEOUT_S.get() + 5)


def drain_writers_at_exit() -> None:
    """In a scheduler process, after its model is built: on SIGTERM and when the process
    returns normally, write every request already queued, at most
    SGLANG_HS_DUMP_DRAIN_TIMEOUT_S seconds, and log what could not be written. Does
    nothing in a process without a writer. Call it from the main thread."""
    if not _writers:
        return
    draining = threading.Event()

    def drain_and_log():
        if draining.is_set():
            return
        draining.set()
        for writer, timeout in _writers:
            _drain(writer, timeout)

    # Run by multiprocessing when a child process (a scheduler) returns normally.
    multiprocessing.util.Finalize(None, drain_and_log, exitpriority=100)
    previous = signal.getsignal(signal.SIGTERM)

    def drain_then_terminate(signum, frame):
        if draining.is_set():
            return  # a drain is under way in this thread: let it finish
        drain_and_log()
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, drain_then_terminate)


def _drain(writer: DumpWriter, timeout: float) -> None:
    queued = writer.queued()
    logger.info(
        f"hidden states dump: exiting; writing {queued} queued requests "
        f"(at most {timeout:g} s)"
    )
    left = writer.drain(timeout)
    if left:
        logger.error(
            f"hidden states dump: exiting with {left} of {queued} queued requests "
            f"not written (SGLANG_HS_DUMP_DRAIN_TIMEOUT_S={timeout:g})"
        )
    else:
        logger.info(f"hidden states dump: wrote the {queued} queued requests before exiting")
    writer.stats.log()
