"""Our decode loop: the sampling behind every GRPO rollout and evaluation answer (modeling.generate),
in plain PyTorch around the model's own forward pass, as nanochat's engine is.

    prefill  each distinct prompt runs once; its keys and values are written to the K rows of its
             group in a static KV cache, preallocated for prompt + max_new_tokens positions;
    decode   one token per step for every row: the step writes one column of the cache in place
             (no torch.cat, no new allocation), then the next token is drawn from exactly
             softmax(logits / T) cut by top-p, the distribution whose log-probs GRPO's ratio and
             KL use (§3.4, Eqs. (8)-(9)); greedy takes the argmax;
    stop     a row ends at its first stop token (eos, <|im_end|>) or where the caller's test says
             so; it is then fed padding, and the loop ends when every row has ended.

It returns what Hugging Face `generate` returns (prompt + completion ids, rows grouped by prompt),
token for token the same under greedy decoding (tests/test_decode.py), and it draws from the
random stream as `generate` does, one torch.multinomial per step over all rows. `generate` stays
the reference path: modeling.generate(engine="hf").

Speed. Decoding one token reads every weight and the whole KV cache, so it is bound by memory, not
arithmetic. Hugging Face's dynamic cache also copies the whole cache at every step (torch.cat);
ours writes one column. Where the hardware has bf16 units (a GPU, an AMX CPU) the rollouts run on a
bf16 copy of the policy (`sampling_model`), which reads half the bytes and casts nothing at run
time, where bf16 autocast casts every weight at every step. On a GPU the decode step is captured
once as a CUDA graph and replayed, so the GPU stops waiting on Python between small kernels.
"""

from __future__ import annotations

import copy
import weakref

import torch

from srt.distributed import all_ranks_any, is_fsdp


# --------------------------------------------------------------------------------------------
# The static KV cache
# --------------------------------------------------------------------------------------------
class StaticKVCache:
    """Every layer's keys and values, [rows, kv_heads, length, head_dim], allocated at the prefill
    and then written in place, so the tensors keep their addresses (CUDA graphs replay on them).
    Each attention layer of a Hugging Face model calls `update` with its new keys and values and
    attends to what it returns.

    The prefill hands in the B distinct prompts; each is written to its `repeats` (= K) rows, and
    the prompt attends to its own keys. A decode step hands in one position for every row: written
    at `column` (a tensor, so a captured step reads where to write), and attention reads the first
    `visible` columns: those written so far (eager), or all of them under a CUDA graph, where the
    attention mask hides the columns not yet written."""

    def __init__(self, rows: int, length: int, repeats: int = 1):
        self.rows, self.length, self.repeats = rows, length, repeats
        self.keys, self.values = {}, {}
        self.column = None
        self.visible = 0

    def update(self, key, value, layer_idx, *args, **kwargs):
        if layer_idx not in self.keys:  # the prefill
            prompt = key.shape[2]
            for store, new in ((self.keys, key), (self.values, value)):
                store[layer_idx] = new.new_zeros(self.rows, new.shape[1], self.length, new.shape[3])
                store[layer_idx].unflatten(0, (-1, self.repeats))[:, :, :, :prompt] = new[:, None]
            return key, value
        self.keys[layer_idx].index_copy_(2, self.column, key)
        self.values[layer_idx].index_copy_(2, self.column, value)
        return self.keys[layer_idx][:, :, : self.visible], self.values[layer_idx][:, :, : self.visible]


def attention_mask(model, allowed):
    """allowed [rows, 1, queries, keys] (True: may attend) as the model's attention takes it: sdpa a
    boolean mask, eager a bias added to the scores (0 or fp32's minimum; the sum promotes to fp32).
    A 4-D mask reaches the attention as it is (transformers' masking_utils passes it through)."""
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        raise ValueError("decode: sliding-window attention layers need their own mask; use engine='hf'")
    kind = model.config._attn_implementation
    if kind == "sdpa":
        return allowed
    if kind == "eager":
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
        return bias.masked_fill(~allowed, torch.finfo(torch.float32).min)
    raise ValueError(f"decode: attention {kind!r} is not supported (sdpa, eager); use engine='hf'")


# --------------------------------------------------------------------------------------------
# The next token: exactly softmax(logits / T) cut by top-p, or the argmax
# --------------------------------------------------------------------------------------------
def top_p_filter(logits, top_p: float):
    """Keep the nucleus (Holtzman et al., 2020): the most likely tokens, best first, while the tokens
    ranked above hold less than top_p of the probability, so the kept mass just reaches top_p; set
    the rest to -inf. The best token always stays. `logits` are already divided by T."""
    if top_p >= 1.0:
        return logits
    ranked, order = logits.sort(dim=-1, descending=True)
    probs = ranked.softmax(dim=-1)
    drop_ranked = probs.cumsum(dim=-1) - probs >= top_p  # the mass of the tokens ranked above
    return logits.masked_fill(drop_ranked.scatter(-1, order, drop_ranked), float("-inf"))


def next_tokens(logits, temperature=1.0, top_p=1.0, greedy=False, suppress=None):
    """logits [rows, V] -> one token per row. Temperature first, then the nucleus of the tempered
    distribution (as Hugging Face's warpers do), then one draw per row by torch.multinomial.
    `suppress`: token ids that may never be drawn (the model's generation_config.suppress_tokens)."""
    logits = logits.float()
    if suppress is not None:
        logits = logits.index_fill(-1, suppress, float("-inf"))
    if greedy:
        return logits.argmax(dim=-1)
    logits = top_p_filter(logits / temperature, top_p)
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(1)


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def decode(
    model,
    input_ids,
    attention_mask_2d,
    max_new_tokens: int,
    stop_ids,
    pad_id: int,
    num_generations: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    stopping=None,
    prefill_once: bool = True,
    synced: bool = False,
    cuda_graph: bool = True,
    static_shapes: bool = False,
):
    """input_ids, attention_mask_2d [B, P]: B distinct prompts, left padded. -> sequences
    [B * K, P + C]: each prompt repeated K times (rows j*K .. j*K+K-1) and its completions, C <=
    max_new_tokens, finished rows padded with pad_id. `stopping(completion_so_far [rows, t])` -> bool
    per row, called after each step, ends rows on the caller's own test (modeling.generate's
    stop_when). prefill_once False prefills each of the K copies of a prompt (the reference for the
    tests). synced: the forward pass communicates (FSDP with sharded weights), so every rank runs
    as many steps as the slowest one. static_shapes: every step attends to all the columns of the
    cache, those not yet written masked, so every step has one shape: what a CUDA graph replays
    (cuda_graph, on a GPU), also available eagerly, where the tests check it."""
    device, K = input_ids.device, num_generations
    if max_new_tokens < 1:
        raise ValueError(f"decode: max_new_tokens must be at least 1, not {max_new_tokens}")
    if not prefill_once:
        input_ids, attention_mask_2d = (t.repeat_interleave(K, dim=0) for t in (input_ids, attention_mask_2d))
    per_prompt = K if prefill_once else 1
    rows, width = input_ids.shape[0] * per_prompt, input_ids.shape[1]
    length = width + max_new_tokens
    cache = StaticKVCache(rows, length, repeats=per_prompt)
    stop_ids = torch.tensor(list(stop_ids), device=device)
    suppress = model.generation_config.suppress_tokens  # the one field of it both engines honour
    suppress = torch.tensor(suppress, device=device) if suppress else None

    # Prefill: causal over the real tokens; a padding position sees itself only (never an empty row).
    real = attention_mask_2d.bool()
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    allowed = (causal & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
    logits = (
        model(
            input_ids=input_ids,
            attention_mask=attention_mask(model, allowed[:, None]),
            position_ids=(attention_mask_2d.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        .logits[:, -1]
        .repeat_interleave(per_prompt, dim=0)
    )

    # The decode step reads these buffers in place (a CUDA graph replays on their addresses).
    key_mask = torch.zeros(rows, length, dtype=torch.bool, device=device)
    key_mask[:, :width] = real.repeat_interleave(per_prompt, dim=0)
    prompt_lengths = real.sum(-1, keepdim=True).repeat_interleave(per_prompt, dim=0)
    tokens = torch.full((rows, 1), pad_id, dtype=torch.long, device=device)
    positions = prompt_lengths.clone()
    cache.column = torch.tensor([width], device=device)

    def step():
        return model(
            input_ids=tokens,
            attention_mask=attention_mask(model, key_mask[:, None, None, : cache.visible]),
            position_ids=positions,
            cache=cache,
            use_cache=True,
        ).logits[:, -1]

    # FSDP's hooks synchronize streams around every forward: no graph under FSDP.
    use_graph = cuda_graph and device.type == "cuda" and not (synced or is_fsdp(model)) and max_new_tokens > 2
    static_shapes = static_shapes or use_graph
    cache.visible = length
    graph, graph_logits = capture_step(step) if use_graph else (None, None)

    completion = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        token = next_tokens(logits, temperature, top_p, greedy, suppress)  # every row: one draw each
        completion[:, t] = torch.where(finished, pad_id, token)
        finished |= torch.isin(completion[:, t], stop_ids)
        if stopping is not None:
            finished |= stopping(completion[:, : t + 1])
        done = bool(finished.all())
        if synced:
            done = not all_ranks_any(not done, device)
        if done or t + 1 == max_new_tokens:
            break
        # Feed the token just drawn: its keys and values go to column width + t, its logits give the next.
        tokens.copy_(completion[:, t : t + 1])
        key_mask[:, width + t] = True
        cache.column.fill_(width + t)
        torch.add(prompt_lengths, t, out=positions)
        if not static_shapes:
            cache.visible = width + t + 1
        if graph is not None:
            graph.replay()
            logits = graph_logits
        else:
            logits = step()
    return torch.cat([input_ids.repeat_interleave(per_prompt, dim=0), completion[:, : t + 1]], dim=1)


def capture_step(step):
    """-> (a CUDA graph of one decode step, its logits buffer), or (None, None) where capture fails:
    the loop then runs the step eagerly. Two eager warm-up runs first (cuBLAS handles, lazy
    buffers); what they write into the cache, the first real step overwrites before reading it."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
        return graph, logits
    except Exception as error:  # noqa: BLE001 any failure to capture falls back to eager decoding
        import warnings

        warnings.warn(f"decode: CUDA graph capture failed ({error!r}); decoding eagerly", stacklevel=2)
        torch.cuda.synchronize()
        return None, None


# --------------------------------------------------------------------------------------------
# Generation weights in the precision the hardware computes fastest
# --------------------------------------------------------------------------------------------
_COPIES = weakref.WeakKeyDictionary()  # a model -> its sampling copy: {"model", "stale", "follows"}


def sampling_model(model, dtype):
    """The model rollouts run on. `dtype` is modeling.resolve_dtype's autocast dtype: bf16 where
    the hardware has bf16 units (a GPU, an AMX CPU), None elsewhere (plain fp32). With bf16 and
    wider weights: a bf16 copy of the model (its forward hooks and tied weights kept; its buffers,
    RoPE's inv_freq, stay fp32), made once and refreshed from the model's weights before a call
    unless `follow_optimizer` knows nothing changed them. The master weights and the loss stay as
    they are. Otherwise (fp32, already narrow, FSDP, which gathers bf16 itself): the model."""
    if dtype is None or any(hasattr(p, "to_local") for p in model.parameters()):
        return model
    if all(p.dtype == dtype for p in model.parameters() if p.is_floating_point()):
        return model
    entry = _COPIES.setdefault(model, {"model": None, "stale": True, "follows": False})
    if entry["model"] is None:  # deepcopy with each parameter's bf16 copy given: no fp32 duplicate
        given = {
            id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
            for p in model.parameters()
            if p.is_floating_point()
        }
        entry["model"], entry["stale"] = copy.deepcopy(model, given).eval(), False
    elif entry["stale"] or not entry["follows"]:
        with torch.no_grad():
            for master, low in zip(model.parameters(), entry["model"].parameters()):
                low.copy_(master)
        entry["stale"] = False
    return entry["model"]


def follow_optimizer(model, optimizer) -> None:
    """After each optimizer step the sampling copy of `model` is stale: the next rollout refreshes
    it once (one cast of the weights), and rollouts with no step in between reuse it."""
    entry = _COPIES.setdefault(model, {"model": None, "stale": True, "follows": False})
    entry["follows"] = True

    def mark_stale(*_):
        entry["stale"] = True

    optimizer.register_step_post_hook(mark_stale)
