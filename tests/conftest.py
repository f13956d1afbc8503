"""Fixtures shared by the training tests."""

import pytest
import torch

from srt.modeling import load_model_and_tokenizer


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny-random", dtype="float32")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors on a shared 2-core box: a second thread only adds contention (2-3x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
