import os
import subprocess
from pathlib import Path

import pytest

from scripts.dumps.tiny_model import ensure_kimi_model, ensure_model
from scripts.paths import REPO_ROOT
from tests.server.dump_checks import dump_export_prompts

# A test stops its server with SIGTERM to the process group; SGLang (0.5.23) takes the
# scheduler's exit for a crash and sleeps 5 s before py-spy and CUDA core dumps that a CPU
# server has no use for. The servers inherit this environment (runtime_env).
os.environ.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
os.environ.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
# SGLang torch.compiles small helpers (DeepSeek's grouped top-k routing among them); on the CPU
# the first prefill then traces and builds C++ for 12 s (26 s on a cold compile cache) of each
# server's start, about half a test server's CPU time. The servers run them eagerly: what the
# tests compare is one server's own computation, which is eager on both sides.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# Test servers share the machine's cores (make test runs three at once), and SGLang's CPU engine
# pins every server's OpenMP threads to the same cores. With OpenMP's default wait policy a
# thread spins at each barrier on a core another server needs: three retraction tests side by
# side on two cores decoded at 5-9 tokens/s, against 300 alone, and each ran past 385 s; waiting
# passively, the three took 141 s. Alone a passive server is slower (109 s against 66), which
# the tests, never timed, can afford; benchmarks keep OpenMP's default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# From 0.5.23 on SGLang's registry takes the model classes of an external package instead of
# importing every model module it has (tests/server/served_models: the two the tests serve),
# 7 CPU-seconds of each server process's start; earlier releases register the package over
# their own modules, which saves nothing, so it is set where it pays.
if tuple(map(int, os.environ["SGLANG_VERSION"].split("."))) >= (0, 5, 23):
    os.environ.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", "tests.server.served_models")


@pytest.fixture(scope="session")
def model_l3():
    return ensure_model(layers=3, q_lora=True)


@pytest.fixture(scope="session")
def model_l5_no_q_lora():
    return ensure_model(layers=5, q_lora=False)


@pytest.fixture(scope="session")
def model_l2():
    return ensure_model(layers=2, q_lora=True)


@pytest.fixture(scope="session")
def kimi_k25_l2():
    """A reduced Kimi-K2.5 whose text model is model_l2."""
    return ensure_kimi_model(layers=2, q_lora=True)


@pytest.fixture(scope="session")
def export_dump(model_l3, tmp_path_factory):
    """A small bf16 dump the export tests read (dump_checks.dump_export_prompts)."""
    return dump_export_prompts(model_l3, tmp_path_factory.mktemp("export") / "dump")



@pytest.fixture
def naive_tree(tmp_path):
    """A scratch checkout of upstream with the seed's naive patch instead of this series."""
    checkout = Path(os.environ["SGLANG_CHECKOUT"])
    tree = tmp_path / "naive"
    patch = REPO_ROOT / "tests" / "fixtures" / f"naive-capture-{os.environ['SGLANG_VERSION']}.patch"
    subprocess.run(["git", "-C", checkout, "worktree", "add", "--detach", "-q", tree, "upstream"], check=True)
    subprocess.run(["git", "-C", tree, "apply", patch], check=True)
    yield tree
    subprocess.run(["git", "-C", checkout, "worktree", "remove", "--force", tree], check=True)
