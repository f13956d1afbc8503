"""Devices and precision: the --device flag's check, the CPU's feature flags, the dtype of the
weights and of autocast (fp32 master weights with bf16 autocast where the hardware has bf16 units),
and the peak GPU memory a run reports."""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path

import torch


def peak_gpu_gb(device) -> float | None:
    """Peak GPU memory allocated so far, GB; None on a CPU."""
    device = torch.device(device)
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def device_flag(text: str) -> str:
    """argparse type of --device: cpu, cuda, cuda:N or mps, and one this torch can use, so that a
    typo or a GPU this machine lacks is one line at the start, not a traceback at the first tensor."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu, or install "
                "a CUDA build of torch on a machine with a GPU"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text}: this machine has {torch.cuda.device_count()} CUDA GPU(s), cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"{text}: this torch sees no Apple GPU (MPS); use --device cpu")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text!r}: this program runs on cpu, cuda, cuda:N or mps")
    return text


def add_device(parser, help="default: cuda when available, else cpu") -> None:
    parser.add_argument("--device", type=device_flag, default=None, help=help)


DTYPES = ("auto", "float32", "bfloat16")  # resolve_dtype's choices


def add_dtype(parser, help) -> None:
    parser.add_argument("--dtype", choices=list(DTYPES), default="auto", help=help)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (the "flags" line of /proc/cpuinfo, what `lscpu`
    prints); an empty set where there is no such file (macOS, Windows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # either one: bf16 autocast is faster than fp32


def cpu_has_fast_bf16() -> bool:
    """True on CPUs whose bf16 matmuls are faster than fp32 ones, where `--dtype auto` turns on bf16
    autocast: those with AMX tiles (`amx_bf16`: Intel Sapphire Rapids and later, oneDNN's tile
    kernels; stage 1 trains 1.5-2x as fast as in fp32, docs/experiments/presets.md) and those with
    AVX512-BF16 (`avx512_bf16`: AMD Zen 4/5, Intel Cooper Lake; oneDNN's vdpbf16ps kernels), where
    bf16 autocast is faster than fp32 in every part of a run (bench/README.md, `precision.py`).
    Elsewhere (AVX2 or plain AVX-512 only) bf16 is converted in software and slower than fp32:
    False. Read from cpu_flags; without them (no /proc/cpuinfo), torch's AMX probe decides."""
    flags = cpu_flags()
    if flags:
        return any(flag in flags for flag in FAST_BF16_FLAGS)
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # older torch: no probe, stay on the safe side
        return False


def resolve_dtype(dtype: str, device) -> tuple[torch.dtype, torch.dtype | None]:
    """-> (dtype of the weights, dtype of autocast or None). 'auto' keeps fp32 master weights and
    adds bf16 autocast wherever the hardware has bf16 units: any GPU, and CPUs with AMX or
    AVX512-BF16 (cpu_has_fast_bf16); elsewhere it stays plain fp32. 'float32' never autocasts (the tests
    that compare against hand-computed values use it)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if dtype == "auto":
        fast_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16())
        return torch.float32, (torch.bfloat16 if fast_bf16 else None)
    if dtype == "float32":
        return torch.float32, None
    if dtype == "bfloat16":
        return torch.bfloat16, None
    raise ValueError(f"unknown dtype {dtype!r}; use auto, float32 or bfloat16")


def autocast(device, autocast_dtype):
    """The forward-pass context for resolve_dtype's second value."""
    if autocast_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype)
