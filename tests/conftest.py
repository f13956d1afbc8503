"""Fixtures shared by the training tests."""

import pytest
import torch

from srt import precision
from srt.loading import load_model_and_tokenizer

# The flags of a CPU without bf16 units (AVX2 only): what every test's CPU looks like to
# precision.cpu_has_fast_bf16, so that `--dtype auto` is plain fp32 in every test (module fixtures
# included), on an AMX Xeon and an avx512_bf16 EPYC as on an AVX2-only one. The tests of the probe
# patch their own flags; a test that starts a script in a subprocess passes --dtype float32.
AVX2_FLAGS = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt fma avx avx2 f16c bmi1 bmi2".split())
REAL_CPU_FLAGS = precision.cpu_flags


@pytest.fixture(autouse=True, scope="session")
def cpu_without_bf16_units():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(precision, "cpu_flags", lambda: set(AVX2_FLAGS))
        yield


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
