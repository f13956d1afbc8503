"""How much GPU memory a training stage needs per rank, printed at the start of each stage and, with
`--dry-run --world-size N`, alone for a machine you are not on. Offline: the model's shape comes
from a local config.json, or, for the models the presets name, from their published shapes.

Per rank, in GB (10^9 bytes), on a GPU (bf16 compute: autocast, or FSDP's MixedPrecisionPolicy):

    weights        P x 4 (fp32 masters; 2 with --dtype bfloat16), / N under FSDP
    gradients      as the weights
    AdamW moments  2 x the weights (AdamW keeps its moments in the weights' dtype)
    DDP buckets    as the gradients, without FSDP on 2+ GPUs (DDP's flat copy for the all-reduce)
    bf16 copies    without FSDP, autocast's cached bf16 weights (2 P); under FSDP the gathered
                   units of one step: the root (embeddings, norm, lm_head) and two layers (the one
                   computing and the one prefetched)
    pi_ref         GRPO with beta > 0: bf16 and sharded under FSDP, else in the weights' dtype.
                   Sharded whole between its forwards: pi_ref has no backward, so its root unit
                   (embeddings, norm, lm_head) too reshards after each forward
                   (distributed.shard_model)
    sampling copy  GRPO without FSDP, bf16 compute over wider weights: the bf16 copy of the policy
                   the rollouts run on (decode.sampling_model, 2 P), kept between rollouts
    rollout        GRPO: the KV cache (layers x 2 x kv_heads x head_dim x 2 bytes a position: with
                   the grouped decode step each prompt's positions once for its K rows, else
                   (prompt + new tokens) for every row); the prefill's activations (no autograd: a
                   layer at a time, 4 h + 3 I numbers a prompt token) and its padding mask; the
                   sampler's fp32 and fp64 copies of each row's logits (decode.next_tokens); and
                   under FSDP the full bf16 weights gathered once per rollout batch
                   (distributed.full_weights)
    activations    per micro-batch of rows x tokens, bf16. A decoder layer keeps about
                   8 h + 2 kv_dim + 4 I numbers per token (norm inputs and outputs, q, k, v, the
                   attention output, the residual, gate, up, act(gate), act(gate) * up; SDPA keeps
                   no tokens x tokens matrix); with gradient checkpointing only the layer input
                   (h per token) stays, and one layer is recomputed at a time. Under autocast the
                   residual stream is in the weights' dtype (fp32): the layer inputs and the four
                   numbers a token the RMSNorms keep
    logits         the logits of the positions that carry a loss (bf16), the gradients of the
                   chunks already back-propagated and four fp32 copies of the chunk of 256
                   positions in back-propagation; or, where they are joined, three bf16 copies of
                   them all (logprobs.token_logprobs)

peak = weights + moments + buckets + pi_ref + sampling copy
       + max(rollout, gradients + copies + activations + logits):
the rollout runs with no gradients (they are freed with set_to_none after every update). A plan
fits when the peak stays under 90% of the GPU's memory (the rest: CUDA context, fragmentation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

GB = 1e9
HEADROOM = 0.9  # share of a GPU's memory a plan may fill
LOGIT_CHUNK = 256  # positions per fp32 chunk in logprobs.token_logprobs
DEFAULT_GPU_GB = 80  # the A100-80GB of §4.1


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    head_dim: int | None = None
    grouped_decode: bool = False  # decode.GroupedStep runs it: a prompt's KV cache once for its K rows

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def layer_parameters(self) -> int:
        q, kv = self.heads * self.dim, self.kv_heads * self.dim
        attention = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        bias = q + 2 * kv if self.attention_bias else 0
        return attention + bias + 3 * self.hidden * self.intermediate + 2 * self.hidden  # + 2 RMSNorms

    def root_parameters(self) -> int:
        """Embeddings, the final norm and (untied) lm_head: the FSDP root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def parameters(self) -> int:
        return self.layers * self.layer_parameters() + self.root_parameters()


# Published shapes (their config.json) of the models the presets name: planned without a download.
QWEN25_7B = Shape(
    hidden=3584,
    layers=28,
    heads=28,
    kv_heads=4,
    intermediate=18944,
    vocab=152064,
    tied=False,
    attention_bias=True,
    grouped_decode=True,
)
SMOLLM2_135M = Shape(
    hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152, tied=True, grouped_decode=True
)
KNOWN_SHAPES = {
    "Qwen/Qwen2.5-7B-Instruct": QWEN25_7B,
    "Qwen/Qwen2.5-7B": QWEN25_7B,
    "smollm2-135m": SMOLLM2_135M,
}


def shape_from_config(config: dict) -> Shape:
    heads = config["num_attention_heads"]
    return Shape(
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        head_dim=config.get("head_dim"),
        # decode.grouped_step_supported, from the config alone (a model with norms on q and k has
        # its own model_type)
        grouped_decode=config.get("model_type") in ("llama", "qwen2")
        and not config.get("mlp_bias", False)
        and "sliding_attention" not in (config.get("layer_types") or []),
    )


def model_shape(name: str) -> Shape:
    """A local folder's config.json, a known name, or tiny-random; nothing is downloaded."""
    if (Path(name) / "config.json").exists():
        return shape_from_config(json.loads((Path(name) / "config.json").read_text()))
    if name in KNOWN_SHAPES:
        return KNOWN_SHAPES[name]
    if name == "tiny-random":
        from srt.loading import load_model_and_tokenizer

        return shape_from_config(load_model_and_tokenizer("tiny-random", dtype="float32")[0].config.to_dict())
    raise SystemExit(
        f"error: no shape for --model {name!r} offline: give a folder with its config.json "
        f"(known without one: {', '.join(KNOWN_SHAPES)})"
    )


@dataclass(frozen=True)
class Run:
    """What a stage will do per rank, in the planner's terms."""

    stage: str  # "sft" or "grpo"
    world_size: int
    fsdp: bool
    dtype: str  # the stage's --dtype: auto (fp32 + bf16 compute), float32, bfloat16
    gradient_checkpointing: bool
    micro_rows: int  # rows per forward / backward
    tokens: int  # tokens per row
    loss_positions: int  # positions per row whose logits enter the loss
    rollouts: int = 0  # GRPO: completions sampled per rank per step (K x prompts)
    with_reference: bool = False  # GRPO with beta > 0
    group_size: int = 1  # GRPO: K, the completions of one prompt
    new_tokens: int = 0  # GRPO: new tokens a completion (the rest of `tokens` is its prompt)


def plan(shape: Shape, run: Run) -> dict:
    """-> {item: bytes per rank}, with "peak"; see the module docstring for each item."""
    P, N = shape.parameters(), run.world_size
    w = 2 if run.dtype == "bfloat16" else 4  # bytes per weight, gradient, AdamW moment
    c = 4 if run.dtype == "float32" else 2  # bytes per number in compute
    autocast = not run.fsdp and c < w
    # Autocast leaves the embedding lookup alone, so the residual stream stays in the weights'
    # dtype; FSDP gathers the embeddings in the compute dtype, and the stream follows.
    r = w if autocast else c
    shards = N if run.fsdp else 1
    items = {
        "weights": w * P / shards,
        "gradients": w * P / shards,
        "adamw": 2 * w * P / shards,
        "ddp_buckets": w * P if (N > 1 and not run.fsdp) else 0,
    }
    if run.fsdp:
        items["compute_copies"] = c * (shape.root_parameters() + 2 * shape.layer_parameters())
    else:
        items["compute_copies"] = c * P if c < w else 0
    if run.with_reference:  # under FSDP all of it, root included, 1/N (tests/test_fsdp.py measures it)
        items["reference"] = (c if run.fsdp else w) * P / shards
    kv_dim = shape.kv_heads * shape.dim
    if run.stage == "grpo":
        # The rollouts' bf16 copy of the policy lives from the first rollout on, refreshed in place.
        items["sampling_copy"] = c * P if autocast else 0
        prompts, prompt_tokens = run.rollouts // run.group_size, run.tokens - run.new_tokens
        if shape.grouped_decode:  # GroupKVCache: the prompt's columns, then each row's completion
            positions = prompts * (prompt_tokens + run.new_tokens * run.group_size)
        else:  # StaticKVCache: prompt + completion for every row
            positions = run.rollouts * run.tokens
        items["kv_cache"] = positions * shape.layers * 2 * kv_dim * c
        # Measured without autograd (a dispatch-mode count of live tensors): the embeddings, which
        # the forward keeps, the residual stream, the next one being formed and a norm's output
        # (4 h), the MLP's gate, its activation and up (3 I) a prompt token; and the padding mask
        # as a boolean and as the additive bias SDPA makes of it.
        items["prefill"] = (
            prompts
            * prompt_tokens
            * (c * (4 * shape.hidden + 3 * shape.intermediate) + (1 + c) * prompt_tokens)
        )
        items["rollout_weights"] = c * P if run.fsdp else 0
        # A step's logits (compute dtype), their fp32 copy and probabilities, and the fp64 copy and
        # cumulative sum that draw() searches.
        items["sampling_logits"] = run.rollouts * shape.vocab * (c + 4 + 4 + 8 + 8)
    per_token_layer = 8 * shape.hidden + 2 * kv_dim + 4 * shape.intermediate
    # The two RMSNorms' inputs and normalised outputs (4 h of the 8 h) are in the residual's dtype.
    layer_bytes = c * per_token_layer + (r - c) * 4 * shape.hidden
    rows_tokens = run.micro_rows * run.tokens
    if run.gradient_checkpointing:
        items["activations"] = rows_tokens * (shape.layers * shape.hidden * r + layer_bytes)
    else:
        items["activations"] = rows_tokens * shape.layers * layer_bytes
    items["logits"] = logit_bytes(run.micro_rows, run.loss_positions, shape.vocab, c)
    persistent = (
        items["weights"]
        + items["adamw"]
        + items["ddp_buckets"]
        + items.get("reference", 0)
        + items.get("sampling_copy", 0)
    )
    rollout = sum(items.get(k, 0) for k in ("kv_cache", "prefill", "rollout_weights", "sampling_logits"))
    training = items["gradients"] + items["compute_copies"] + items["activations"] + items["logits"]
    return dict(
        items,
        persistent=persistent,
        rollout=rollout,
        training=training,
        peak=persistent + max(rollout, training),
        parameters=P,
    )


def logit_bytes(rows: int, positions: int, vocab: int, c: int) -> int:
    """The loss's logits at their largest (logprobs.token_logprobs, measured with a dispatch-mode
    count of live tensors): `positions` logits a row in the compute dtype, the last predicting
    nothing, the others split into chunks of LOGIT_CHUNK. Back-propagating a chunk holds four fp32
    copies of it (logits / T, kept for the backward; the gather's gradient; logsumexp's z - lse and
    its exp) beside the bf16 gradients of the chunks done before it; the entropy of the first pass
    holds as many in the forward. Once every chunk is done, their gradients are joined into one
    tensor, then padded to all the positions: three copies of the logits at once."""
    logits = c * rows * positions * vocab
    scored = max(positions - 1, 1)
    chunks = -(-scored // LOGIT_CHUNK)
    chunk_fp32 = 4 * rows * min(scored, LOGIT_CHUNK) * vocab
    return logits + max(logits * (chunks - 1) / chunks + 4 * chunk_fp32, 2 * logits)


def fits(peak_bytes: float, gpu_gb: float) -> bool:
    return peak_bytes <= HEADROOM * gpu_gb * GB


def smallest_fsdp_world(shape: Shape, run: Run, gpu_gb: float, most: int = 64) -> int | None:
    """The fewest GPUs on which the same run fits with FSDP, or None up to `most`."""
    for n in range(1, most + 1):
        if fits(plan(shape, replace(run, world_size=n, fsdp=True))["peak"], gpu_gb):
            return n
    return None


def format_plan(name: str, shape: Shape, run: Run, gpu_gb: float) -> str:
    p = plan(shape, run)
    N = run.world_size
    w = "bf16" if run.dtype == "bfloat16" else "fp32"
    c = "fp32" if run.dtype == "float32" else "bf16"
    part = f", sharded 1/{N}" if run.fsdp and N > 1 else ""
    layout = (
        f"FSDP over {N} GPU(s)"
        if run.fsdp
        else (f"DDP over {N} GPUs (full replicas)" if N > 1 else "one GPU")
    )
    ckpt = "with" if run.gradient_checkpointing else "without"
    other = plan(shape, replace(run, gradient_checkpointing=not run.gradient_checkpointing))["activations"]
    lines = [
        f"memory plan per GPU: {'stage 1 (SFT)' if run.stage == 'sft' else 'stage 2 (GRPO)'}, {name} "
        f"({p['parameters'] / 1e9:.2f} B parameters), {layout}, {w} weights, {c} compute (GB = 10^9 bytes)",
        f"  weights ({w}{part})".ljust(84) + f"{p['weights'] / GB:8.2f}",
        f"  AdamW moments (2 x {w}{part})".ljust(84) + f"{p['adamw'] / GB:8.2f}",
    ]
    if p["ddp_buckets"]:
        lines.append(f"  DDP gradient buckets ({w})".ljust(84) + f"{p['ddp_buckets'] / GB:8.2f}")
    if "reference" in p:
        lines.append(
            f"  reference model pi_ref ({c if run.fsdp else w}{part}, no gradients)".ljust(84)
            + f"{p['reference'] / GB:8.2f}"
        )
    if p.get("sampling_copy"):
        lines.append(
            f"  sampling copy of the policy ({c}, for the rollouts)".ljust(84)
            + f"{p['sampling_copy'] / GB:8.2f}"
        )
    if run.stage == "grpo":
        prompts, prompt_tokens = run.rollouts // run.group_size, run.tokens - run.new_tokens
        layout = (
            f"{prompts} x ({prompt_tokens} + {run.group_size} x {run.new_tokens})"
            if shape.grouped_decode
            else f"{run.rollouts} x {run.tokens}"
        )
        lines += [
            f"  rollout: KV cache ({layout} tokens x {shape.layers} layers x 2 x "
            f"{shape.kv_heads} x {shape.dim} x {c})".ljust(84)
            + f"{p['kv_cache'] / GB:8.2f}",
            f"  rollout: prefill activations ({prompts} x {prompt_tokens} tokens, one layer at a time)".ljust(
                84
            )
            + f"{p['prefill'] / GB:8.2f}",
            f"  rollout: sampling logits ({run.rollouts} x {shape.vocab}, fp32 and fp64 copies)".ljust(84)
            + f"{p['sampling_logits'] / GB:8.2f}",
        ]
        if p["rollout_weights"]:
            lines.append(
                f"  rollout: full {c} weights, gathered once per batch".ljust(84)
                + f"{p['rollout_weights'] / GB:8.2f}"
            )
    copies = "gathered FSDP units (root + 2 layers)" if run.fsdp else "autocast weight copies"
    lines += [
        f"  training: gradients ({w}{part})".ljust(84) + f"{p['gradients'] / GB:8.2f}",
        f"  training: {copies} ({c})".ljust(84) + f"{p['compute_copies'] / GB:8.2f}",
        f"  training: activations ({run.micro_rows} rows x {run.tokens} tokens, {ckpt} checkpointing; "
        f"{'without' if run.gradient_checkpointing else 'with'}: {other / GB:.2f})".ljust(84)
        + f"{p['activations'] / GB:8.2f}",
        f"  training: logits and their gradient ({run.micro_rows} x {run.loss_positions} positions)".ljust(84)
        + f"{p['logits'] / GB:8.2f}",
    ]
    if run.stage == "grpo":
        lines.append(
            f"  (rollout phase {p['rollout'] / GB:.2f}, training phase {p['training'] / GB:.2f}: "
            "they never overlap)"
        )
    peak_line = (
        "  peak = weights + moments"
        + (" + buckets" if p["ddp_buckets"] else "")
        + (" + pi_ref" if "reference" in p else "")
        + (" + copy" if p.get("sampling_copy") else "")
        + (" + max(rollout, training)" if run.stage == "grpo" else " + training")
    )
    lines.append(peak_line.ljust(84) + f"{p['peak'] / GB:8.2f}")
    if fits(p["peak"], gpu_gb):
        lines.append(
            f"fits: {p['peak'] / GB:.1f} GB of {gpu_gb:g} GB per GPU "
            f"(at most {HEADROOM:.0%}: the rest for the CUDA context and fragmentation)"
        )
    else:
        fewest = smallest_fsdp_world(shape, run, gpu_gb)
        advice = (
            f"with --fsdp it fits on {fewest} GPU(s) or more"
            if fewest
            else "even --fsdp on 64 GPUs does not fit: lower --micro-batch-size / lengths"
        )
        lines.append(
            f"WARNING: does not fit: needs {p['peak'] / GB:.1f} GB per GPU, more than {HEADROOM:.0%} of "
            f"{gpu_gb:g} GB; {advice}; --gradient-checkpointing and a smaller micro-batch shrink the rest"
        )
    return "\n".join(lines)


def gpu_memory_gb(requested: float | None) -> float:
    import torch

    if requested:
        return requested
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GB
    return DEFAULT_GPU_GB


# --------------------------------------------------------------------------------------------
# The stages' settings in the planner's terms
# --------------------------------------------------------------------------------------------
ASSUMED_PROMPT_TOKENS = 4096  # GRPO with --max-prompt-length 0 (no cap): plan for this


def stage_run(stage: str, args, world_size: int) -> Run:
    """stage1_sft's or stage2_grpo's parsed arguments -> Run."""
    if stage == "sft":  # logits from the earliest target on: planned for the whole row, the worst case
        return Run(
            "sft",
            world_size,
            args.fsdp,
            args.dtype,
            args.gradient_checkpointing,
            args.batch_size,
            args.max_length,
            args.max_length,
        )
    rows = args.prompts_per_step * args.num_generations
    minibatch = -(-rows // min(args.sample_ratio, rows))  # the largest of the sample_ratio minibatches
    micro = min(args.micro_batch_size or minibatch, minibatch)
    tokens = (args.max_prompt_length or ASSUMED_PROMPT_TOKENS) + args.max_new_tokens
    return Run(
        "grpo",
        world_size,
        args.fsdp,
        args.dtype,
        args.gradient_checkpointing,
        micro,
        tokens,
        args.max_new_tokens + 1,
        rollouts=rows,
        with_reference=args.beta > 0,
        group_size=args.num_generations,
        new_tokens=args.max_new_tokens,
    )


def stage_plan(stage: str, args, world_size: int, config=None) -> str:
    """The plan a stage prints at its start, from the loaded model's `config`, and alone with
    --dry-run, from model_shape(--model)."""
    shape = shape_from_config(config.to_dict()) if config is not None else model_shape(args.model)
    return format_plan(
        args.model, shape, stage_run(stage, args, world_size), gpu_memory_gb(args.gpu_memory_gb)
    )
