"""drain_before_kill, with real processes: it waits for the schedulers (the processes that
hold writers) to drain, and not for a process that ignores SIGTERM, as multiprocessing's
resource tracker does (waiting for it held every shutdown of a dumping server for the whole
drain timeout)."""

import subprocess
import sys
import threading

import psutil
import pytest

from sglang.srt.hidden_states_dump import lifecycle

# A scheduler that takes a moment to drain: exits a little after SIGTERM.
SCHEDULER = """
import signal, sys, time, setproctitle
setproctitle.setproctitle("sglang::scheduler_TP0")
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.5), sys.exit(0)))
print("ready", flush=True)
while True:
    time.sleep(1)
"""
IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def started(code: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    return process


@pytest.fixture
def processes():
    popens = [started(SCHEDULER), started(IGNORES_SIGTERM)]
    yield popens
    for popen in popens:
        popen.kill()
        popen.wait()


def drain_in_a_thread(targets) -> threading.Thread:
    thread = threading.Thread(target=lifecycle.drain_before_kill, args=(targets,), daemon=True)
    thread.start()
    return thread


def test_waits_for_the_scheduler_and_not_for_a_process_ignoring_sigterm(processes, dumping_on, monkeypatch):
    monkeypatch.setenv("SGLANG_HS_DUMP_DRAIN_TIMEOUT_S", "3600")
    scheduler, ignoring = processes
    thread = drain_in_a_thread([psutil.Process(p.pid) for p in processes])
    # Joined well before the drain timeout: it did not wait for the process ignoring SIGTERM.
    thread.join(timeout=120)
    assert not thread.is_alive(), "drain_before_kill is waiting for a process that ignores SIGTERM"
    assert scheduler.poll() == 0, "the scheduler was not let finish its drain"
    assert ignoring.poll() is None, "the process ignoring SIGTERM is left to the caller"


def test_a_process_titled_otherwise_is_not_waited_for(dumping_on):
    # Negative control of the title check: the same scheduler code under another title is
    # terminated but not waited for, so the call returns while it is still draining.
    slow = started(SCHEDULER.replace("sglang::scheduler_TP0", "sglang::detokenizer").replace("0.5", "30"))
    try:
        thread = drain_in_a_thread([psutil.Process(slow.pid)])
        thread.join(timeout=20)
        assert not thread.is_alive()
        assert slow.poll() is None
    finally:
        slow.kill()
        slow.wait()

