import pytest

from scripts.dumps.tiny_model import ensure_model


@pytest.fixture(scope="session")
def model_l3():
    return ensure_model(layers=3, q_lora=True)


@pytest.fixture(scope="session")
def model_l5_no_q_lora():
    return ensure_model(layers=5, q_lora=False)
