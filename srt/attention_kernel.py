"""Stage 1's --attention bf16_eager: an attention kernel that keeps the scores in bf16 from the
product to the softmax, faster than SDPA on a bf16 CPU with other rounding (bench/README.md,
sft_step.py), and what a run says of it where it runs in fp32. Registered under its name so that
`model.set_attn_implementation("bf16_eager")` selects it."""

from __future__ import annotations

import torch


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
