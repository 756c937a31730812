import os
import sys
from unittest import mock

import pytest

# The patched SGLang tree under test goes first on the path: the runtime venv holds
# upstream SGLang, which must not be the one these tests import.
sys.path.insert(0, os.environ["SGLANG_CHECKOUT"])

import sglang  # noqa: E402

assert os.path.realpath(sglang.__file__).startswith(
    os.path.realpath(os.environ["SGLANG_CHECKOUT"]) + os.sep
), f"imported {sglang.__file__}, not the checkout {os.environ['SGLANG_CHECKOUT']}"


# The release under test: the series differs where upstream changed.
RELEASE = tuple(int(part) for part in os.environ["SGLANG_VERSION"].split("."))


def pytest_configure(config):
    # The modules that test the dump's own machinery with real processes (writer processes,
    # manifests, several writers, the Mooncake sink): they call nothing of SGLang's, so CI runs
    # them with the release whose whole server suite it runs, and `make test-matrix` deselects
    # them (-m "not same_on_every_release") for the other releases, as it runs only their
    # test-warmup. `make test-unit SGLANG_VERSION=<v>` runs them all.
    config.addinivalue_line(
        "markers", "same_on_every_release: the dump's own machinery, calling nothing of SGLang's"
    )


@pytest.fixture
def dump_dir(tmp_path):
    path = tmp_path / "dump"
    path.mkdir()
    return path


@pytest.fixture
def dumping_on(dump_dir, monkeypatch):
    """SGLANG_HS_DUMP_DIR set, as the server's processes see it (dump_enabled reads it once)."""
    from sglang.srt.hidden_states_dump.config import dump_enabled

    monkeypatch.setenv("SGLANG_HS_DUMP_DIR", str(dump_dir))
    dump_enabled.cache_clear()
    yield dump_dir
    dump_enabled.cache_clear()


@pytest.fixture(autouse=True)
def writer_processes_end():
    """Each writer process a test starts ends with the test (a server's ends with its
    scheduler process)."""
    from sglang.srt.hidden_states_dump.process_writer import ProcessDumpWriter

    started = []
    init = ProcessDumpWriter.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        started.append(self)

    with mock.patch.object(ProcessDumpWriter, "__init__", recording_init):
        yield
    for writer in started:
        writer.stop(timeout=10)
