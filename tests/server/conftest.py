import os
import sys
from pathlib import Path

import pytest

# The patched SGLang tree under test, so that tests read dumps with its own reader.
sys.path.insert(0, os.environ["SGLANG_CHECKOUT"])

from scripts.tiny_model import ensure_model  # noqa: E402


@pytest.fixture(scope="session")
def model_l3():
    return ensure_model(layers=3, q_lora=True)


@pytest.fixture(scope="session")
def model_l5_no_q_lora():
    return ensure_model(layers=5, q_lora=False)
