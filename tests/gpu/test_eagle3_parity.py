"""Train/serve parity on a GPU (tests/server/eagle3_parity.py says how), CUDA graphs on as
served: the features SGLang's EAGLE-3 feeds the draft for a prompt's prefill equal, bit for
bit, the rows the dump writes for it. Both servers run the prefill eagerly here (the dump's
series declines prefill graphs for dumped prefills; SGLang's EAGLE-3 target prefill runs
its extend without one), so the kernels are the same.

Run by scripts/bench/gpu/run_checks.sh on the GPU machine; skipped where there is no GPU.
"""

import time

import pytest

from scripts.dumps.server import has_gpu
from scripts.dumps.tiny_model import ensure_model
from tests.gpu.test_gpu_capture import record_result
from tests.server.eagle3_parity import check_parity, release

pytestmark = pytest.mark.skipif(not has_gpu(), reason="needs a GPU")

NUM_LAYERS = 8  # SGLang's no-ids default, [2, L//2, L-3], is three distinct layers from 6 on


@pytest.fixture(scope="module")
def target():
    return ensure_model(layers=NUM_LAYERS, q_lora=True, widths="deepseek")


@pytest.mark.parametrize("draft_ids", [[1, 4, 6], [2, 4, 6], None],
                         ids=["first-id-1", "first-id-not-1", "no-ids"])
def test_the_dump_is_what_the_draft_is_fed(target, draft_ids, tmp_path):
    started = time.monotonic()
    fed, error = check_parity(target, draft_ids, tmp_path, extra_args=["--cuda-graph-max-bs", "4"])
    record_result(f"eagle3-parity-{draft_ids}", {
        "release": release(), "draft_class": "LlamaForCausalLMEagle3", "draft_ids": draft_ids,
        "fed_layers": fed, "bit_exact": error == 0.0, "seconds": round(time.monotonic() - started, 1)})
