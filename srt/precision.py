"""Devices and precision: the --device flag's check, the CPU's feature flags, the dtype of the
weights and of autocast (fp32 master weights with bf16 autocast where the hardware has bf16 units),
stage 1's optional attention kernel with its scores kept in bf16 (--attention bf16_eager), and the
peak GPU memory a run reports."""

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


def bf16_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """stage 1's --attention bf16_eager: softmax(Q K^T * scaling, masked) V, written out as Hugging
    Face's eager attention is, but with the scores kept in bf16 from the product to the softmax
    (which sums in fp32 inside). On a bf16 CPU SDPA's flash kernel, its backward most of all, is
    slow, and eager adds an fp32 mask to the scores, so the widest tensor of a layer, rows x heads x
    tokens x tokens, is written in fp32, softmaxed, then cast back to bf16 for the product with V
    (the same rounding as here, where the softmax writes bf16 at once): a lesson step in 0.84x
    SDPA's time, with the scores rounded to bf16 where SDPA keeps them in fp32 (bench/README.md).
    `attention_mask`: True where a query may attend (boolean_mask); a masked score becomes bf16's
    lowest, not -inf, so that a row with nothing to attend (left padding) is uniform, as in eager,
    not NaN. Grouped keys and values (3 for SmolLM2's 9 heads) are repeated to every head, as
    eager's repeat_kv does."""
    groups = module.num_key_value_groups
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query * scaling, key.transpose(2, 3))
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    probs = torch.nn.functional.dropout(scores.softmax(dim=-1), p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def boolean_mask(*args, **kwargs):
    """The mask bf16_eager_attention reads: SDPA's boolean mask, never skipped for is_causal."""
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


def bf16_eager_in_fp32(weight_dtype, autocast_dtype) -> bool:
    """bf16_eager_attention computes in the dtype its inputs come in: bf16 under bf16 autocast or with
    bf16 weights. In an fp32 run (--dtype float32, or auto on a CPU without bf16 units) nothing is
    bf16, and it is eager attention in fp32: what a run or a benchmark says of it must say so."""
    return weight_dtype == torch.float32 and autocast_dtype is None


def bf16_eager_note(dtype: str) -> str:
    """The line a run with --attention bf16_eager prints where bf16_eager_in_fp32."""
    why = "--dtype float32" if dtype == "float32" else f"--dtype {dtype}, which is fp32 here"
    return (
        f"note: --attention bf16_eager in an fp32 run ({why}): nothing runs in bf16, so it is the eager "
        "attention kernel in fp32"
    )


def register_bf16_eager() -> str:
    """Make bf16_eager_attention a kernel `model.set_attn_implementation` can name -> its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("bf16_eager", bf16_eager_attention)
    AttentionMaskInterface.register("bf16_eager", boolean_mask)
    return "bf16_eager"


def autocast(device, autocast_dtype):
    """The forward-pass context for resolve_dtype's second value."""
    if autocast_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype)
