"""Train/serve parity on the CPU (tests/server/eagle3_parity.py says how), where SGLang's
CPU path serves EAGLE-3: there both servers run the same kernels, so bit for bit. Where it
does not, every case skips, naming the release and the error, after one server start: seen
here, the draft's KV pool warm-up needs a GPU kernel in every locked release (0.5.9 and
0.5.14 launch a Triton kernel, and Triton finds no driver; 0.5.23 calls an sgl_kernel op
its CPU build lacks). tests/gpu/test_eagle3_parity.py runs the same on a GPU."""

import pytest

from scripts.dumps.tiny_model import ensure_model
from tests.server.eagle3_parity import check_parity

NUM_LAYERS = 8


@pytest.fixture(scope="module")
def target():
    return ensure_model(layers=NUM_LAYERS)


@pytest.mark.parametrize("draft_ids", [[1, 4, 6], [2, 4, 6], None],
                         ids=["first-id-1", "first-id-not-1", "no-ids"])
def test_the_dump_is_what_the_draft_is_fed(target, draft_ids, tmp_path):
    check_parity(target, draft_ids, tmp_path)
