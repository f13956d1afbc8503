"""Our decode loop: the sampling behind every GRPO rollout and evaluation answer (generation.generate),
in plain PyTorch, as nanochat's engine is.

    prefill  each distinct prompt runs once, through the model's own forward (plainly causal where
             no prompt is padded, else under a mask that hides the padding); its keys and values
             go to a static KV cache, preallocated for prompt + max_new_tokens positions;
    decode   one token per step for every row: the step writes its keys and values in place (no
             torch.cat, no new allocation), then the next token is drawn from exactly
             softmax(logits / T) cut by top-p and suppressed tokens, and its log-probability under
             that distribution is kept (GRPO's log pi_sampler, §3.4: stage 2 weighs the sampler
             against pi_old, and refuses top-p < 1, which its ratio would not see); greedy takes
             the argmax;
    stop     a row ends at its first stop token (eos, <|im_end|>) or where the caller's test says
             so; it is then fed padding, and the loop ends when every row has ended;
    copies   recall by pointer (--recall copy, srt/recall.py): once a row has written `<HIS>A3:`,
             the program appends the rest of that turn and `</HIS>`; the grouped step writes the
             whole copy in one forward, and the row's next token is drawn after it.

It returns what Hugging Face `generate` returns (prompt + completion ids, rows grouped by prompt),
token for token the same under greedy decoding (tests/test_decode.py); sampled, it draws from the
same distribution with its own random numbers (inverse transform, one uniform number per row).
`generate` stays the reference path: generation.generate(engine="hf").

Speed. Decoding one token reads every weight and the whole KV cache, so it is bound by memory, not
arithmetic. For Llama-family models the decode step is written out (GroupedStep): the K samples of
a prompt attend to the prompt's keys and values together, in one attention call per layer, so the
prompt is read once per group instead of K times, and on a CPU the weights are prepacked for the
matmul. Other architectures run the model's own forward at every step (StaticKVCache). Where the
hardware has bf16 units (a GPU, a CPU with AMX or AVX512-BF16: precision.cpu_has_fast_bf16, the rule
of precision.resolve_dtype, whose autocast dtype decides it) the rollouts run on a bf16 copy of the
policy (`sampling_model`), which reads half the bytes and casts nothing at run time, where bf16
autocast casts every weight at every step; under FSDP they run on the weights gathered for the batch
(distributed.full_weights), as a module without FSDP's hooks. On a GPU the decode step is captured
once as a CUDA graph and replayed, so the GPU stops waiting on Python between small kernels.
"""

from __future__ import annotations

import copy
import weakref

import torch

from srt.distributed import all_ranks_any, is_fsdp, is_gathered, plain_module
from srt.precision import autocast


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

    # What Hugging Face's mask helpers ask a cache when the prefill hands them no mask (prompts
    # without padding): the prompt attends to itself only, from column 0.
    def get_query_offset(self, layer_idx=0):
        return 0

    def get_mask_sizes(self, query_length, layer_idx=0):
        return query_length, 0


def check_attention(model) -> None:
    """The attentions whose masks `attention_mask` writes: sdpa and eager, full attention."""
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        raise ValueError("decode: sliding-window attention layers need their own mask; use engine='hf'")
    kind = model.config._attn_implementation
    if kind not in ("sdpa", "eager"):
        raise ValueError(f"decode: attention {kind!r} is not supported (sdpa, eager); use engine='hf'")


def attention_mask(model, allowed):
    """allowed [rows, 1, queries, keys] (True: may attend) as the model's attention takes it: sdpa a
    boolean mask, eager a bias added to the scores (0 or fp32's minimum; the sum promotes to fp32).
    A 4-D mask reaches the attention as it is (transformers' masking_utils passes it through).
    decode() has run check_attention before any call."""
    if model.config._attn_implementation == "sdpa":
        return allowed
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
    return bias.masked_fill(~allowed, torch.finfo(torch.float32).min)


# --------------------------------------------------------------------------------------------
# The grouped step: the decode step of a Llama-family model, written out
# --------------------------------------------------------------------------------------------
class GroupKVCache:
    """The grouped step's cache, one sequence of keys (and one of values) per prompt and layer,
    [B, kv_heads, P + C * K, head_dim]: the prompt's P columns once, then the completion columns of
    its K rows interleaved by step, so that step t writes columns P + t*K .. P + t*K + K - 1 and an
    eager step reads only the columns written so far. A layer's keys and values are two halves of
    one tensor, `store[layer]` [B, 2 * kv_heads, ...], which a step writes with one copy. The
    prefill (the model's own forward) hands each layer's prompt keys and values to `update`."""

    def __init__(self, rows: int, width: int, length: int, group_size: int):
        self.rows, self.width, self.K = rows, width, group_size
        self.columns = width + (length - width) * group_size
        self.store, self.keys, self.values = {}, {}, {}
        self.column = None  # the absolute column (width + t) the loop is at: a tensor, for CUDA graphs
        self.visible = 0  # the loop's absolute visible length: width + steps written (or all of them)

    def update(self, key, value, layer_idx, *args, **kwargs):  # the prefill only
        batch, kv_heads, _, head_dim = key.shape
        store = key.new_zeros(batch, 2 * kv_heads, self.columns, head_dim)
        store[:, :, : self.width] = torch.cat([key, value], dim=1)
        self.store[layer_idx] = store
        self.keys[layer_idx], self.values[layer_idx] = store[:, :kv_heads], store[:, kv_heads:]
        return key, value

    get_query_offset, get_mask_sizes = StaticKVCache.get_query_offset, StaticKVCache.get_mask_sizes


def grouped_step_supported(model) -> bool:
    """The architectures GroupedStep writes out: Llama (SmolLM2) and Qwen2 (biases on q, k, v),
    full attention in every layer, no norm on queries or keys."""
    config = model.config
    layers = getattr(getattr(model, "model", None), "layers", None)
    return (
        config.model_type in ("llama", "qwen2")
        and layers is not None
        and "sliding_attention" not in (getattr(config, "layer_types", None) or [])
        and not getattr(config, "mlp_bias", False)
        and not hasattr(layers[0].self_attn, "q_norm")
    )


def fused_linears(model) -> list[tuple]:
    """The decode step's weight products, those that read the same input made one: each layer's
    (q, k, v) projections of the attention's input, its (gate, up) projections of the MLP's, then
    o, down and the lm_head alone. One product of the stacked weights gives the outputs of the
    separate ones side by side; on a CPU, where each call costs a dispatch, it is 120 calls fewer
    a step for SmolLM2's 30 layers."""
    groups = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups += [
            (attn.q_proj, attn.k_proj, attn.v_proj),
            (attn.o_proj,),
            (mlp.gate_proj, mlp.up_proj),
            (mlp.down_proj,),
        ]
    return groups + [(model.lm_head,)]


def packed_weights(model, rows: int) -> dict:
    """{a group of fused_linears: its stacked weight packed for the CPU's matmul library} on a CPU,
    else {} (the modules run as they are). A prepacked weight is laid out once as the library's
    kernel reads it, instead of at every call: in bf16 oneDNN's blocked layout (what torch.compile's
    CPU freezing pass makes), in fp32 MKL's packed GEMM for `rows` rows. The products are the same
    up to the order of the sums (tests/test_decode.py; bench/README.md has the speed)."""
    head = model.lm_head.weight
    kind = packing_kind(head)
    if kind is None:
        return {}
    packed = {}
    for group in fused_linears(model):
        weight = torch.cat([m.weight.detach() for m in group]) if len(group) > 1 else group[0].weight.detach()
        biases = [m.bias.detach() if m.bias is not None else head.new_zeros(m.out_features) for m in group]
        bias = None if all(m.bias is None for m in group) else torch.cat(biases)
        packed[group] = pack(kind, weight, bias, rows)
    return packed


def packing_kind(weight) -> str | None:
    """The library that packs weights of this dtype on this device: "onednn" (bf16), "mkl" (fp32),
    or None (not a CPU, or no such library: the modules run as they are)."""
    if weight.device.type != "cpu":
        return None
    if weight.dtype == torch.bfloat16 and onednn_has_bf16():
        return "onednn"
    if weight.dtype == torch.float32 and torch.backends.mkl.is_available():
        return "mkl"
    return None


def pack(kind: str, weight, bias, rows: int) -> tuple:
    """One weight [out, in] packed for `rows` rows -> (kind, packed, plain weight or None, bias)."""
    if kind == "onednn":  # oneDNN keeps only its own layout
        return kind, torch.ops.mkldnn._reorder_linear_weight(weight, rows), None, bias
    # MKL's op also takes the plain weight (its path for another row count)
    return kind, torch.ops.mkl._mkl_reorder_linear_weight(weight, rows), weight, bias


def packed_linear(packed, x, rows: int):
    """x times a group's stacked weight through its packed copy: the outputs of the group's modules
    side by side (the modules' forward hooks do not fire)."""
    kind, weight, plain, bias = packed
    if kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, weight, plain, bias, rows)


def onednn_has_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


_PACKED = weakref.WeakKeyDictionary()  # a model -> (the versions of its weights and rows, the packed weights)


def packed_for(model, rows: int) -> dict:
    """packed_weights, made again only when a weight has changed since (an in-place update, such as
    the refresh of the sampling copy after an optimizer step, bumps the tensor's version) or the
    number of rows has (MKL packs for one)."""
    key = (rows, weight_versions(model))
    if model in _PACKED and _PACKED[model][0] == key:
        return _PACKED[model][1]
    _PACKED.pop(model, None)  # free the stale copies before packing new ones
    _PACKED[model] = (key, packed_weights(model, rows))
    return _PACKED[model][1]


class GroupedStep:
    """One decode step of a Llama-family model for `rows` = B prompts x K samples, written out.

    A step must read every weight and the cache; what it can choose is how often, and in how many
    calls. The K rows of a group share their prompt, so the group is one sequence of queries to
    the attention: the K * G query heads that share a key/value head (grouped-query attention,
    G = heads / kv_heads) attend in one call over the prompt's keys, read once per group instead of
    once per row, and over the group's completion keys, of which a mask leaves each row its own.
    This is exact attention, the same softmax over the same keys as the model's own forward.
    Norms, rotary embeddings, the embedding and the activation are the model's own modules."""

    def __init__(self, model, cache: GroupKVCache):
        config = model.config
        self.model, self.cache, self.K = model, cache, cache.K
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        groups = fused_linears(model)
        self.layer_linears, self.head = [groups[i : i + 4] for i in range(0, len(groups) - 1, 4)], groups[-1]
        self.packed = packed_for(model, cache.rows)
        device, K, G = model.lm_head.weight.device, self.K, self.heads // self.kv_heads
        # Query r*G + g (row r of the group, head g) may see completion column P + t*K + r' iff r' == r.
        own_row = torch.arange(K, device=device)
        self.own_pattern = (own_row[:, None, None] == own_row).repeat_interleave(G, 0)  # [K*G, 1, K]
        self.own_offsets = own_row

    def linear(self, group, x):
        """The outputs of a group of fused_linears side by side, through its packed stacked weight
        where there is one (the modules' forward hooks then fire in the prefill only, the model's
        own forward)."""
        packed = self.packed.get(group)
        if packed is not None:
            return packed_linear(packed, x, self.cache.rows)
        return group[0](x) if len(group) == 1 else torch.cat([m(x) for m in group], dim=-1)

    def attention_bias(self, key_mask):
        """key_mask [rows, length] (True: a key the row may attend; absolute columns) -> the additive
        mask [B, 1, K*G, visible columns] of the grouped layout: each prompt's padding hidden, and of
        the completion columns each row sees its own, those written so far."""
        cache, K = self.cache, self.K
        prompt = key_mask[::K, None, : cache.width].expand(-1, self.own_pattern.shape[0], -1)  # [B, K*G, P]
        written = key_mask[:, cache.width : cache.visible].unflatten(0, (-1, K))  # [B, K, steps]
        own = written.repeat_interleave(self.heads // self.kv_heads, 1)[..., None] & self.own_pattern
        allowed = torch.cat([prompt, own.flatten(2, 3)], -1)  # [B, K*G, P + steps*K]
        bias = torch.zeros(allowed.shape, dtype=self.model.lm_head.weight.dtype, device=allowed.device)
        return bias.masked_fill_(~allowed, float("-inf"))[:, None]

    def __call__(self, tokens, positions, key_mask):
        """tokens, positions [rows, 1]; key_mask [rows, length]. Writes this step's keys and values
        (cache.column = width + t) to the K columns of step t; -> logits [rows, V]."""
        cache, K = self.cache, self.K
        columns = cache.width + (cache.column - cache.width) * K + self.own_offsets  # [K], every group
        visible = cache.width + (cache.visible - cache.width) * K
        return self.forward(tokens, positions, columns, self.attention_bias(key_mask), visible)[:, -1]

    def forward(self, tokens, positions, columns, bias, visible: int):
        """tokens, positions [rows, Q]: Q consecutive positions of every row (Q = 1 but where a copy
        is written); columns: where their keys and values go, [K * Q] the same for every group
        (the one-token step) or [B, K * Q]; bias [B, 1, K * Q * G, visible]. -> logits [rows, Q, V].
        The queries of a kv head are ordered (row, position, head of the row)."""
        inner, cache, K = self.model.model, self.cache, self.K
        H, KV, d = self.heads, self.kv_heads, self.head_dim
        rows, Q = tokens.shape
        groups, G = rows // K, H // KV
        hidden = inner.embed_tokens(tokens)  # [rows, Q, d_model]
        cos, sin = inner.rotary_emb(hidden, positions)  # [rows, Q, d]: one position per token
        cos, sin = cos[:, :, None], sin[:, :, None]
        group_of = torch.arange(groups, device=tokens.device)[:, None]  # with columns [B, K * Q]
        for i, (layer, (qkv, o, gate_up, down)) in enumerate(zip(inner.layers, self.layer_linears)):
            attn = layer.self_attn
            heads = self.linear(qkv, layer.input_layernorm(hidden)).view(rows, Q, H + 2 * KV, d)
            # RoPE on the queries and keys together, written back: keys and values then lie side by
            # side, [rows, Q, 2 * KV, d], as the cache holds them.
            heads[:, :, : H + KV] = apply_rotary(heads[:, :, : H + KV], cos, sin)
            # [rows, Q, H, d] -> [B, KV, K * Q * G, d]: the group's queries of one kv head together
            q = heads[:, :, :H].reshape(groups, K, Q, KV, G, d).permute(0, 3, 1, 2, 4, 5).flatten(2, 4)
            new = heads[:, :, H:].reshape(groups, K * Q, 2 * KV, d).transpose(1, 2)  # [B, 2KV, K*Q, d]
            if columns.dim() == 1:
                cache.store[i].index_copy_(2, columns, new)
            else:  # group b's columns[b] (scatter_ would copy the whole cache: 50x slower on a CPU)
                cache.store[i][group_of, :, columns] = new.transpose(1, 2)
            keys, values = cache.store[i][:, :KV, :visible], cache.store[i][:, KV:, :visible]
            out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, bias, scale=attn.scaling)
            out = out.unflatten(2, (K, Q, G)).permute(0, 2, 3, 1, 4, 5).reshape(rows, Q, H * d)  # by row
            hidden = hidden + self.linear(o, out)
            gate, up = self.linear(gate_up, layer.post_attention_layernorm(hidden)).chunk(2, dim=-1)
            hidden = hidden + self.linear(down, layer.mlp.act_fn(gate) * up)
        return self.linear(self.head, inner.norm(hidden))

    def paced_bias(self, prompt_mask, last_seen, steps: int):
        """The mask of a step where each row is at its own completion index and feeds Q positions
        (decode_with_copies): prompt_mask [B, P] (True: a real prompt column); last_seen [rows, Q],
        the last completion index query (row, position) may see, itself included; steps: the
        completion indices the keys span. -> [B, 1, K * Q * G, P + steps * K]. Completion index n
        of row r sits at column P + n * K + r, as in the one-token step."""
        K, G = self.K, self.heads // self.kv_heads
        rows, Q = last_seen.shape
        seen = torch.arange(steps, device=last_seen.device) <= last_seen[..., None]  # [rows, Q, steps]
        own = (
            seen.view(-1, K, Q, 1, steps, 1)
            & torch.eye(K, dtype=torch.bool, device=seen.device)[None, :, None, None, None, :]
        )  # [B, K, Q, 1, steps, K]: only the row's own columns
        own = own.expand(-1, -1, -1, G, -1, -1).reshape(rows // K, K * Q * G, steps * K)
        prompt = prompt_mask[:, None, :].expand(-1, K * Q * G, -1)
        allowed = torch.cat([prompt, own], -1)
        bias = torch.zeros(allowed.shape, dtype=self.model.lm_head.weight.dtype, device=allowed.device)
        return bias.masked_fill_(~allowed, float("-inf"))[:, None]


def apply_rotary(x, cos, sin):
    """Rotary position embeddings (RoFormer), as Llama's attention applies them to its queries and
    keys: x [rows, heads, head_dim]; cos, sin [rows, 1, head_dim] from the model's own rotary module."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


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
    """logits [rows, V] -> (one token per row, its log-probability under the distribution it was
    drawn from). Temperature first, then the nucleus of the tempered distribution (as Hugging Face's
    warpers do), then one draw per row by inverse transform. `suppress`: token ids that may never be
    drawn (the model's generation_config.suppress_tokens). The log-probability is the sampler's own
    log pi_sampler(o_t), which GRPO's importance weight compares with pi_old (stage2_grpo.py); a
    greedy choice has probability 1 (log-probability 0)."""
    logits = logits.float()
    if suppress is not None:
        logits = logits.index_fill(-1, suppress, float("-inf"))
    if greedy:
        best = logits.argmax(dim=-1)
        return best, torch.zeros(best.shape, device=logits.device)
    probs = top_p_filter(logits / temperature, top_p).softmax(dim=-1)
    tokens = draw(probs)
    return tokens, probs.gather(1, tokens[:, None]).squeeze(1).log()


def draw(probs):
    """One token per row of probs [rows, V] (not necessarily summing to 1) by inverse transform."""
    # Inverse transform: u uniform on (0, total], the token is the first i with cdf_i >= u, which
    # happens with probability (cdf_i - cdf_{i-1}) / total = p_i. One uniform number per row, not
    # one per token as torch.multinomial's exponential race draws (V of them, most of the cost of
    # a draw on a CPU: bench/README.md). The cumulative sum is in fp64, so its rounding moves no
    # probability by more than ~1e-12. A token of p = 0 adds an empty interval: never drawn, as
    # u > 0 and u <= total (1 - U lies in (0, 1] exactly for fp64's U in [0, 1)).
    cdf = probs.double().cumsum(dim=-1)
    u = (1 - torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)) * cdf[:, -1:]
    return torch.searchsorted(cdf, u).squeeze(1)


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------
def last_column(width: int, device):
    """logits_to_keep for the prefill, which needs the logits of the last column only: as an index
    tensor, not the int 1. Hugging Face slices hidden[:, -1:] for an int, a view whose strides
    torch's matmul cannot fold into one matrix product: for a weight that takes no gradient (the
    sampling copy, the reference model) it then expands the lm_head weight per prompt and copies
    it (about 170 ms a prompt for SmolLM2 in bf16 on a CPU, bench/README.md). An index tensor
    gathers a fresh [B, 1, d] tensor, which multiplies as one product."""
    return torch.tensor([width - 1], device=device)


def sample(model, encoded, *, max_new_tokens, stop_ids, pad_id, autocast_dtype, synced, **settings):
    """generation.generate's engine "ours": decode on sampling_model's copy of the model, under
    autocast where the copy is the model itself. encoded: the tokenizer's left-padded prompts;
    settings: decode's sampling settings. -> (sequences [B * K, P + C], the sampler's
    log-probs [B * K, C], True where the copy rule wrote the token [B * K, C])."""
    sampler = sampling_model(model, autocast_dtype)
    # Inference mode: a decode step's ~700 small ops skip autograd's bookkeeping (version
    # counters, view tracking), about 4% of a rollout on a CPU (bench/README.md). Not on an
    # FSDP module, whose hooks manage the parameters' storage; inside full_weights the sampler
    # is the plain module over the gathered weights, which has none.
    inference = not (synced or is_fsdp(sampler))
    device = encoded.input_ids.device
    with autocast(device, autocast_dtype if sampler is model else None), torch.inference_mode(inference):
        sequences, sampler_logprobs, copied = decode(
            sampler,
            encoded.input_ids,
            encoded.attention_mask,
            max_new_tokens,
            stop_ids,
            pad_id,
            synced=synced,
            with_logprobs=True,
            **settings,
        )
    # A normal tensor again: stage 2's loss embeds these ids, and autograd cannot save an
    # inference tensor for the backward pass.
    return sequences.clone(), sampler_logprobs.clone(), copied


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
    grouped: bool = True,
    with_logprobs: bool = False,
    copy_rule=None,
):
    """input_ids, attention_mask_2d [B, P]: B distinct prompts, left padded. -> sequences [B * K, P
    + C]: each prompt repeated K times (rows j*K .. j*K+K-1) and its completions, C <=
    max_new_tokens, finished rows padded with pad_id. with_logprobs: -> (sequences, logprobs [B * K,
    C], copied [B * K, C]): each completion token's log-probability under the distribution it was
    drawn from (next_tokens; 0 on padding and on copied tokens), which GRPO keeps as log pi_sampler,
    and True where copy_rule wrote the token. `stopping(completion_so_far [rows, t])` -> bool per
    row, called after each step, ends rows on the caller's own test (generation.generate's stop_when).
    prefill_once False prefills each of the K copies of a prompt (the reference for the tests).
    synced: the forward pass communicates (FSDP with sharded weights), so every rank runs as many
    steps as the slowest one. static_shapes: every step attends to all the columns of the cache,
    those not yet written masked, so every step has one shape: what a CUDA graph replays
    (cuda_graph, on a GPU), also available eagerly, where the tests check it. grouped: decode with
    GroupedStep where the architecture allows (grouped_step_supported, and no FSDP); False runs the
    model's own forward at every step, the general path the tests compare it with.
    copy_rule(row, completion ids so far) -> ids (srt/recall.py CopyRule, --recall copy): the
    tokens the program appends to the row now, a turn of its history; written in one forward with
    the grouped step (decode_with_copies), else one a step, where a step must keep one shape (a CUDA
    graph, static_shapes) or the caller tests text after every token (stopping)."""
    device, K = input_ids.device, num_generations
    if max_new_tokens < 1:
        raise ValueError(f"decode: max_new_tokens must be at least 1, not {max_new_tokens}")
    check_attention(model)
    if not prefill_once:
        input_ids, attention_mask_2d = (t.repeat_interleave(K, dim=0) for t in (input_ids, attention_mask_2d))
    per_prompt = K if prefill_once else 1
    rows, width = input_ids.shape[0] * per_prompt, input_ids.shape[1]
    length = width + max_new_tokens
    grouped = grouped and grouped_step_supported(model) and not (synced or is_fsdp(model))
    one_shape = static_shapes or (cuda_graph and device.type == "cuda")
    # A copied turn is written in one forward where a step may take several positions a row.
    copying = grouped and copy_rule is not None and stopping is None and not one_shape
    if grouped:  # a step that writes a copy feeds up to copy_rule.longest positions past the row's end
        cache = GroupKVCache(rows, width, length + (copy_rule.longest if copying else 0), per_prompt)
    else:
        cache = StaticKVCache(rows, length, repeats=per_prompt)
    stop_ids = torch.tensor(list(stop_ids), device=device)
    suppress = model.generation_config.suppress_tokens  # the one field of it both engines honour
    suppress = torch.tensor(suppress, device=device) if suppress else None
    logits = prefill(model, input_ids, attention_mask_2d, cache, per_prompt)
    real = attention_mask_2d.bool()
    grouped_step = GroupedStep(model, cache) if grouped else None
    if copying:
        sequences, logprobs, copied = decode_with_copies(
            grouped_step, input_ids.repeat_interleave(per_prompt, dim=0), real, logits, max_new_tokens,
            stop_ids, pad_id, temperature, top_p, greedy, suppress, copy_rule,
        )  # fmt: skip
    else:
        # FSDP's hooks synchronize streams around every forward: no graph under FSDP.
        use_graph = (
            cuda_graph and device.type == "cuda" and not (synced or is_fsdp(model)) and max_new_tokens > 2
        )
        sequences, logprobs, copied = decode_token_by_token(
            model, grouped_step, cache, input_ids, real, per_prompt, logits, max_new_tokens, stop_ids, pad_id,
            (temperature, top_p, greedy, suppress), copy_rule, stopping, synced, static_shapes or use_graph,
            use_graph,
        )  # fmt: skip
    return (sequences, logprobs, copied) if with_logprobs else sequences


def prefill(model, input_ids, attention_mask_2d, cache, per_prompt):
    """The prompts' forward into `cache` -> the logits of each prompt's last position, repeated for
    its `per_prompt` rows [rows, V]. Causal over the real tokens; a padding position sees itself only
    (never an empty row). Prompts without padding pass no mask: the model's attention is then plainly
    causal, and SDPA skips the upper half of the scores instead of computing it and masking it out."""
    device, width = input_ids.device, input_ids.shape[1]
    real = attention_mask_2d.bool()
    prefill_mask = None
    if not bool(real.all()):
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        allowed = (causal & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
        prefill_mask = attention_mask(model, allowed[:, None])
    logits = (
        model(
            input_ids=input_ids,
            attention_mask=prefill_mask,
            position_ids=(attention_mask_2d.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
            logits_to_keep=last_column(width, device),
        )
        .logits[:, -1]
        .repeat_interleave(per_prompt, dim=0)
    )
    if not cache.keys:  # an older transformers takes the cache as past_key_values and drops `cache`
        import transformers

        raise RuntimeError(
            f"decode: the model's forward wrote no keys or values to the cache it was handed "
            f"(transformers {transformers.__version__}); install the version of requirements.txt"
        )
    return logits


def decode_token_by_token(
    model, grouped_step, cache, input_ids, real, per_prompt, logits, max_new_tokens, stop_ids, pad_id,
    sampling, copy_rule, stopping, synced, static_shapes, use_graph,
):  # fmt: skip
    """decode's loop, one token a row a step, after the prefill: input_ids and real [B, P] (False:
    padding), logits [rows, V] of the prefill, sampling (temperature, top_p, greedy, suppress) for
    next_tokens. A copy_rule's turn is written here one token a step. -> (sequences [rows, P + C],
    log-probabilities [rows, C], True where copy_rule wrote the token [rows, C])."""
    device, width = input_ids.device, input_ids.shape[1]
    rows, length = real.shape[0] * per_prompt, width + max_new_tokens
    # The decode step reads these buffers in place (a CUDA graph replays on their addresses).
    key_mask = torch.zeros(rows, length, dtype=torch.bool, device=device)
    key_mask[:, :width] = real.repeat_interleave(per_prompt, dim=0)
    prompt_lengths = real.sum(-1, keepdim=True).repeat_interleave(per_prompt, dim=0)
    tokens = torch.full((rows, 1), pad_id, dtype=torch.long, device=device)
    positions = prompt_lengths.clone()
    cache.column = torch.tensor([width], device=device)

    def step():
        if grouped_step is not None:
            return grouped_step(tokens, positions, key_mask)
        return model(
            input_ids=tokens,
            attention_mask=attention_mask(model, key_mask[:, None, None, : cache.visible]),
            position_ids=positions,
            cache=cache,
            use_cache=True,
        ).logits[:, -1]

    cache.visible = length
    graph, graph_logits = capture_step(step) if use_graph else (None, None)

    completion = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, max_new_tokens, device=device)
    copied = torch.zeros(rows, max_new_tokens, dtype=torch.bool, device=device)  # written by copy_rule
    queues = [[] for _ in range(rows)]  # each row's copied tokens still to write, one a step here
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        token, logprob = next_tokens(logits, *sampling)  # every row: one draw each
        for row in (r for r in range(rows) if queues[r]):  # the program's token, not the draw
            token[row], logprob[row], copied[row, t] = queues[row].pop(0), 0.0, not finished[row]
        completion[:, t] = torch.where(finished, pad_id, token)
        logprobs[:, t] = torch.where(finished, 0.0, logprob)
        finished |= torch.isin(completion[:, t], stop_ids)
        if copy_rule is not None:
            for row in range(rows):
                if not finished[row] and not queues[row]:
                    queues[row] = list(copy_rule(row, completion[row, : t + 1].tolist()))
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
    sequences = torch.cat([input_ids.repeat_interleave(per_prompt, dim=0), completion[:, : t + 1]], dim=1)
    return sequences, logprobs[:, : t + 1], copied[:, : t + 1]


def decode_with_copies(
    step, prompts, prompt_real, logits, max_new_tokens, stop_ids, pad_id,
    temperature, top_p, greedy, suppress, copy_rule,
):  # fmt: skip
    """decode's loop where the program's copies are written in one forward: prompts [rows, P] (each
    prompt's K rows), prompt_real [B, P] (False: padding), logits [rows, V] of the prefill. ->
    (sequences [rows, P + C], the completion tokens' log-probabilities [rows, C], True where
    copy_rule wrote the token [rows, C]). A step feeds every row's last token and, where copy_rule
    has handed the row a turn, the turn's tokens after it; the row's next token is drawn from the
    logits after the copy's last token. So each row moves at its own pace: completion index n of
    row r is at cache column P + n * K + r, as in the one-token loop, but n differs by row."""
    rows, width = prompts.shape
    K, device = step.K, prompts.device
    own_row = torch.arange(rows, device=device) % K
    prompt_lengths = prompt_real.sum(-1, keepdim=True).repeat_interleave(K, dim=0)
    # The row's context, prompt then completion, and one spare column that writes past a row's end
    # go to (never returned).
    context = torch.cat([prompts, prompts.new_full((rows, max_new_tokens + 1), pad_id)], 1)
    logprobs = torch.zeros(context.shape, device=device)  # of each token written, where it is written
    copied = torch.zeros(context.shape, dtype=torch.bool, device=device)  # written by copy_rule
    written = torch.zeros(rows, dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    spare = context.shape[1] - 1

    def append(new, new_logprobs, counts, new_copied):
        """Write new[:, :counts] (their log-probabilities, whether the program wrote them) after each
        row's completion, up to and including its first stop token and within max_new_tokens; a
        finished row writes nothing."""
        offsets = torch.arange(new.shape[1], device=device)
        keep = (offsets < counts[:, None]) & (written[:, None] + offsets < max_new_tokens)
        keep &= ~finished[:, None]
        stop = torch.isin(new, stop_ids) & keep
        keep &= (stop.long().cumsum(1) - stop.long()) == 0  # nothing after the first stop token
        target = torch.where(keep, width + written[:, None] + offsets, spare)
        context.scatter_(1, target, new)
        logprobs.scatter_(1, target, torch.where(keep, new_logprobs, 0.0))
        copied.scatter_(1, target, keep & new_copied)
        written.add_(keep.sum(1))
        finished.logical_or_((stop & keep).any(1) | (written >= max_new_tokens))

    first, first_logprob = next_tokens(logits, temperature, top_p, greedy, suppress)
    not_copied = torch.zeros(rows, 1, dtype=torch.bool, device=device)
    append(first[:, None], first_logprob[:, None], torch.ones_like(written), not_copied)
    while not bool(finished.all()):
        # Does the row's end open a tag? Then the program writes the rest of the turn (srt/recall.py).
        so_far, done = written.tolist(), finished.tolist()
        pending = [
            [] if done[r] else list(copy_rule(r, context[r, width : width + so_far[r]].tolist()))
            for r in range(rows)
        ]
        # A copy stops at max_new_tokens, as one token a step stops it; append then drops the draw.
        counts = [min(len(p), max_new_tokens - n) for p, n in zip(pending, so_far)]
        Q = 1 + max(counts)
        copies = torch.tensor(
            [p[:c] + [pad_id] * (Q - 1 - c) for p, c in zip(pending, counts)], dtype=torch.long, device=device
        ).view(rows, Q - 1)
        counts = torch.tensor(counts, device=device)
        # The row's last token (not yet in the cache) and its copy, at completion indices
        # written - 1 .. written - 2 + Q; each sees the prompt and its own row up to itself.
        tokens = torch.cat([context.gather(1, width + written[:, None] - 1), copies], 1)
        index = written[:, None] - 1 + torch.arange(Q, device=device)
        columns = (width + index * K + own_row[:, None]).view(-1, K * Q)
        steps = int(index.max()) + 1
        bias = step.paced_bias(prompt_real, index, steps)
        step_logits = step.forward(tokens, prompt_lengths + index, columns, bias, width + steps * K)
        # The row's own token: drawn from p(. | context, copy), the logits at the copy's last token.
        token, logprob = next_tokens(
            step_logits[torch.arange(rows, device=device), counts], temperature, top_p, greedy, suppress
        )
        new = torch.cat([copies, copies.new_full((rows, 1), pad_id)], 1).scatter(
            1, counts[:, None], token[:, None]
        )
        new_logprobs = torch.zeros(rows, Q, device=device).scatter(1, counts[:, None], logprob[:, None])
        # The program's tokens have log-probability 0 and copied True: GRPO's policy_mask leaves them out.
        append(new, new_logprobs, counts + 1, torch.arange(Q, device=device) < counts[:, None])
    end = width + int(written.max())
    return context[:, :end], logprobs[:, width:end], copied[:, width:end]


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
_COPIES = weakref.WeakKeyDictionary()  # a model -> its sampling copy: {"model", "stale", "versions"}


def weight_versions(model) -> tuple:
    """Every parameter's version counter, which each in-place change (copy_, an optimizer's update
    but a fused one's) increments: equal tuples, unchanged weights."""
    return tuple(p._version for p in model.parameters())


def sampling_model(model, dtype):
    """The model rollouts run on. `dtype` is precision.resolve_dtype's autocast dtype: bf16 where
    the hardware has bf16 units (a GPU, a CPU with AMX or AVX512-BF16), None elsewhere (plain fp32).
    With bf16 and wider weights: a bf16 copy of the model (its forward hooks and tied weights kept;
    its buffers, RoPE's inv_freq, stay fp32), made once and refreshed from the model's weights
    before a call if they have changed since: their versions moved, or any optimizer stepped one
    of them (watch_optimizers; a fused optimizer changes no version). The master weights and the
    loss stay as they are. FSDP inside full_weights: the gathered weights, already in FSDP's
    compute dtype, as a plain module (distributed.plain_module), no copy. Otherwise (fp32, already
    narrow, FSDP with sharded weights, whose every forward gathers): the model."""
    watch_optimizers()
    entry = _COPIES.setdefault(model, {"model": None, "stale": True, "versions": None})
    if is_fsdp(model):
        if not is_gathered(model):
            return model
        entry["model"] = plain_module(model)
        return entry["model"]
    if dtype is None or all(p.dtype == dtype for p in model.parameters() if p.is_floating_point()):
        return model
    if entry["model"] is None:  # deepcopy with each parameter's bf16 copy given: no fp32 duplicate
        given = {
            id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
            for p in model.parameters()
            if p.is_floating_point()
        }
        entry["model"] = copy.deepcopy(model, given).eval()
    elif entry["stale"] or entry["versions"] != weight_versions(model):
        with torch.no_grad():
            for master, low in zip(model.parameters(), entry["model"].parameters()):
                low.copy_(master)
    entry["stale"], entry["versions"] = False, weight_versions(model)
    return entry["model"]


_WATCHING = []  # the handle of the one process-wide optimizer hook, once registered


def watch_optimizers() -> None:
    """After an optimizer step the weights rollouts read are stale, even where the step changed no
    version (torch's fused AdamW writes the weights in place without bumping their version
    counters): the next rollout must refresh the sampling copy once and pack the weights again;
    rollouts with no step in between reuse them. Whoever steps (stage 2's
    train(), a test or a benchmark calling grpo_step with an optimizer of its own), the step must be
    seen, so the sampling path itself registers, once per process, a hook torch runs after every
    optimizer's step (torch.optim.optimizer.register_optimizer_step_post_hook), and the hook marks
    stale each model with a sampling copy or packed weights whose parameters that optimizer holds."""
    if not _WATCHING:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _WATCHING.append(register_optimizer_step_post_hook(_after_optimizer_step))


def _after_optimizer_step(optimizer, *_) -> None:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model, entry in list(_COPIES.items()):
        if not any(id(p) in stepped for p in model.parameters()):
            continue  # another model's optimizer (a stage-1 run in the same process, a test)
        entry["stale"] = True
        # Packed weights of the old weights are of no further use: free them before the next rollout
        # (the model's own in fp32, the sampling copy's, or those of FSDP's gathered weights).
        for sampler in (model, entry["model"]):
            if sampler is not None:
                _PACKED.pop(sampler, None)
