"""Our decode loop (srt/decode.py) against Hugging Face `generate`, the reference path of
generation.generate (engine="hf"), on the tiny random Llama in fp32.

Exact equality of greedy token ids is what is asserted, also across machines (AVX2 fp32, AMX): both
paths run the same model in fp32 and differ only in how the work is split into calls and in the
order of the sums, so their logits agree to the last few bits; an argmax could differ only where
two candidates are within ~1e-6 of each other, which the tiny model's logits (spread ~1, fp32
rounding ~1e-7) do not come near on these prompts. Sampled, ours draws with its own random numbers
(inverse transform, one uniform number per row), so against generate it is held to the distribution:
draws counted against softmax(logits / T) cut by top-p."""

import copy
import math

import pytest
import torch

from srt import decode, generation
from srt.loading import load_model_and_tokenizer

PROMPTS = [
    "Hello",
    "Q1: I need the Chakra Balancing service. A1: It is $180. Q2: and the price?",
    "What time does the spa open on Monday?",
]


def both(model, tokenizer, prompts=PROMPTS, **kwargs):
    """generation.generate through each engine, from the same seed."""
    out = {}
    for engine in ("ours", "hf"):
        torch.manual_seed(0)
        out[engine] = generation.generate(model, tokenizer, prompts, engine=engine, **kwargs)
    return out["ours"], out["hf"]


def assert_same(ours, hf):
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert torch.equal(ours[key], hf[key]), key
    assert ours["texts"] == hf["texts"] and ours["generated_tokens"] == hf["generated_tokens"]


# ---------------------------------------------------------------------------------------------
# Greedy: token for token what generate gives
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 3])
def test_greedy_equals_generate_on_prompts_of_different_lengths(tiny, K):
    model, tokenizer = tiny
    ours, hf = both(model, tokenizer, max_new_tokens=24, num_generations=K, greedy=True)
    assert ours["prompt_mask"][0, 0] == 0  # "Hello" is left padded
    assert ours["completion_ids"].shape == (3 * K, 24)
    assert_same(ours, hf)


def test_rows_end_at_their_first_stop_token_as_in_generate():
    """Plant a stop token: the token greedy decoding writes 4th in row 0. Every row must end at its
    own first occurrence of it (the stop token counted, padding after it), exactly where generate
    ends it, and the loop stops once every row has ended."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    free = generation.generate(model, tokenizer, PROMPTS, max_new_tokens=20, greedy=True)
    planted = int(free["completion_ids"][0, 3])
    model.generation_config.eos_token_id = [*model.generation_config.eos_token_id, planted]
    ours, hf = both(model, tokenizer, max_new_tokens=20, greedy=True)
    assert_same(ours, hf)
    expected = []
    for row in free["completion_ids"].tolist():  # the same greedy path up to the stop
        expected.append(row.index(planted) + 1 if planted in row else 20)
    assert ours["generated_tokens"] == expected and expected[0] == 4
    assert ours["completion_ids"].shape[1] == max(expected)
    for i, n in enumerate(expected):
        assert (ours["completion_ids"][i, n:] == tokenizer.pad_token_id).all()


def test_both_engines_honour_the_models_suppress_tokens():
    """bench/grpo_vs_trl.py forces every row to the cap by suppressing the stop tokens through the
    model's generation_config: the planted stop token of the test above is then never written."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    free = generation.generate(model, tokenizer, PROMPTS, max_new_tokens=20, greedy=True)
    planted = int(free["completion_ids"][0, 3])
    model.generation_config.eos_token_id = [*model.generation_config.eos_token_id, planted]
    model.generation_config.suppress_tokens = generation.stop_token_ids(model, tokenizer)
    ours, hf = both(model, tokenizer, max_new_tokens=20, greedy=True)
    assert_same(ours, hf)
    assert ours["generated_tokens"] == [20, 20, 20] and planted not in ours["completion_ids"]


def test_stop_when_ends_each_row_where_generate_ends_it(tiny):
    """evaluate's direct methods stop a row at its first complete line: the decoded text is tested
    after every step. Here: once the text is at least as long as row 1's first 5 tokens."""
    model, tokenizer = tiny
    free = generation.generate(model, tokenizer, PROMPTS, max_new_tokens=16, greedy=True)
    target = len(tokenizer.decode(free["completion_ids"][1, :5], skip_special_tokens=True))
    ours, hf = both(
        model, tokenizer, max_new_tokens=16, greedy=True, stop_when=lambda text: len(text) >= target
    )
    assert_same(ours, hf)
    assert ours["generated_tokens"][1] == 5 and min(ours["generated_tokens"]) < 16


def test_the_static_shape_step_a_cuda_graph_replays_gives_the_same_tokens(tiny):
    """On a GPU the decode step attends to every column of the cache, those not yet written masked,
    so that one captured graph serves every step. Run eagerly here, it must decode as the step
    that reads only the written columns does."""
    model, tokenizer = tiny
    tokenizer.padding_side = "left"
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    stops = generation.stop_token_ids(model, tokenizer)
    runs = [
        decode.decode(
            model,
            enc.input_ids,
            enc.attention_mask,
            20,
            stops,
            tokenizer.pad_token_id,
            num_generations=2,
            greedy=True,
            static_shapes=static,
        )  # fmt: skip
        for static in (False, True)
    ]
    assert torch.equal(runs[0], runs[1])


def test_eager_attention_takes_the_mask_as_a_bias_and_decodes_the_same():
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    model.set_attn_implementation("eager")
    ours, hf = both(model, tokenizer, max_new_tokens=12, num_generations=2, greedy=True)
    assert_same(ours, hf)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("K", [1, 3])
def test_a_prompt_without_padding_prefills_under_the_models_own_causal_mask(attention, K):
    """Where no prompt is padded the prefill hands the model no mask, so its attention is plainly
    causal (SDPA then skips the scores above the diagonal): the tokens must still be generate's. A
    padded batch must still get its own mask, which hides the padding."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    model.set_attn_implementation(attention)
    prompts = [PROMPTS[1]]
    ours, hf = both(model, tokenizer, prompts, max_new_tokens=16, num_generations=K, greedy=True)
    assert ours["prompt_mask"].all()
    assert_same(ours, hf)

    masks = []
    model.register_forward_pre_hook(lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    stops = generation.stop_token_ids(model, tokenizer)
    for batch in (prompts, PROMPTS):
        tokenizer.padding_side = "left"
        enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        decode.decode(model, enc.input_ids, enc.attention_mask, 1, stops, tokenizer.pad_token_id, greedy=True)
    assert masks[0] is None and masks[1] is not None and masks[1].shape[-2:] == enc.input_ids.shape[-1:] * 2


def test_decode_refuses_sliding_window_attention_before_any_work():
    """The loop writes full-attention masks: a model with sliding-window layers is refused up front,
    also where the prompt is unpadded and the prefill would pass no mask."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    enc = tokenizer([PROMPTS[1]], return_tensors="pt", add_special_tokens=False)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="sliding-window"):
        decode.decode(model, enc.input_ids, enc.attention_mask, 1, [0], tokenizer.pad_token_id, greedy=True)
    assert not calls


@pytest.mark.parametrize("grouped", [True, False])
def test_decode_refuses_a_forward_that_drops_its_cache(grouped):
    """A transformers older than requirements.txt's takes the cache as `past_key_values` and drops the
    `cache` keyword into **kwargs: the prefill then writes nothing to our cache. The grouped step
    used to fail later with a bare KeyError, and the general step to decode every token without the
    prompt, silently; now the loop stops right after the prefill, naming the cause."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")

    def drop_cache(module, args, kwargs):
        return args, {key: value for key, value in kwargs.items() if key != "cache"}

    model.register_forward_pre_hook(drop_cache, with_kwargs=True)
    enc = tokenizer([PROMPTS[1]], return_tensors="pt", add_special_tokens=False)
    with pytest.raises(RuntimeError, match="wrote no keys or values to the cache"):
        decode.decode(model, enc.input_ids, enc.attention_mask, 3, [0], 0, greedy=True, grouped=grouped)


# ---------------------------------------------------------------------------------------------
# The grouped step (Llama family): the K rows of a group attend to their prompt together
# ---------------------------------------------------------------------------------------------
def decode_both_steps(model, tokenizer, prompts=PROMPTS, seed=0, **kwargs):
    """decode.decode through the grouped step and through the model's own forward, same seed."""
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    stops = generation.stop_token_ids(model, tokenizer)
    runs = []
    for grouped in (True, False):
        torch.manual_seed(seed)
        runs.append(decode.decode(model, enc.input_ids, enc.attention_mask, 20, stops, tokenizer.pad_token_id,
                                  grouped=grouped, **kwargs))  # fmt: skip
    return runs


@pytest.mark.parametrize(
    "K, static, packed", [(1, False, True), (3, False, True), (3, True, True), (3, True, False)]
)
def test_grouped_step_decodes_what_the_models_own_forward_decodes(tiny, K, static, packed, monkeypatch):
    """Greedy and sampled (T = 0.7, top-p 0.9), prompts of three lengths (left padding): the grouped
    step must give the tokens of the model's own forward, also with every column of the cache
    attended and the unwritten ones masked (static shapes, the CUDA-graph path), and with the
    modules run as they are, their outputs side by side, where nothing is packed (a GPU). Both run
    the same fp32 model and the same softmax over the same keys, summed in another order (one call
    over the group's keys against one per row): logits agree to ~1e-6, far below the gaps between
    the tiny model's candidates here."""
    model, tokenizer = tiny
    if not packed:
        monkeypatch.setattr(decode, "packed_for", lambda model, rows: {})
    assert decode.grouped_step_supported(model)
    greedy = decode_both_steps(model, tokenizer, num_generations=K, greedy=True, static_shapes=static)
    assert torch.equal(greedy[0], greedy[1])
    sampled = decode_both_steps(
        model, tokenizer, num_generations=K, temperature=0.7, top_p=0.9, static_shapes=static
    )
    assert torch.equal(sampled[0], sampled[1])
    if K > 1:  # K samples, not K copies
        assert len({tuple(r) for r in sampled[0][3:6].tolist()}) > 1


def test_grouped_mask_leaves_each_row_its_own_completion_and_hides_padding(tiny):
    """One prompt of 3 columns whose first is padding, K = 2 rows, G = 2 query heads per kv head,
    after 2 steps: the completion columns are P + t*K + r. Query r*G + g may see prompt columns 1, 2
    and its own row's columns 3 + 2t + r; a mask that let a row see its sibling's completion would
    let the K samples of a group read each other."""
    model, _ = tiny
    cache = decode.GroupKVCache(rows=2, width=3, length=6, group_size=2)
    step = decode.GroupedStep(model, cache)
    key_mask = torch.tensor([[False, True, True, True, True, False]] * 2)
    cache.visible = 5  # width + 2 steps written
    allowed = step.attention_bias(key_mask)[0, 0].isfinite()  # [K*G, P + 2*K]
    expected = torch.tensor(
        [[0, 1, 1, 1, 0, 1, 0],  # row 0 (heads 0, 1): columns 3 (t=0) and 5 (t=1)
         [0, 1, 1, 1, 0, 1, 0],
         [0, 1, 1, 0, 1, 0, 1],  # row 1 (heads 2, 3): columns 4 and 6
         [0, 1, 1, 0, 1, 0, 1]], dtype=torch.bool)  # fmt: skip
    assert torch.equal(allowed, expected)


def test_group_cache_holds_each_prompt_once_then_the_steps_interleaved():
    cache = decode.GroupKVCache(rows=6, width=2, length=5, group_size=3)  # 2 prompts x K = 3, 3 steps
    keys = torch.arange(4, dtype=torch.float32).reshape(2, 1, 2, 1) + 1
    returned, _ = cache.update(keys, -keys, layer_idx=0)
    assert torch.equal(returned, keys)  # the prompt attends to its own keys
    assert cache.keys[0].shape == (2, 1, 2 + 3 * 3, 1)  # once per prompt, not per row
    assert torch.equal(cache.keys[0][:, :, :2], keys) and torch.equal(cache.values[0][:, :, :2], -keys)
    assert (cache.keys[0][:, :, 2:] == 0).all()


def tiny_variant(tokenizer, kind):
    """A 2-layer Qwen2 (biases on q, k, v) or a Llama with biased MLP projections (not written out)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
        with torch.no_grad():  # biases are zero at init: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, mlp_bias=True))
    model.generation_config.eos_token_id = generation.stop_token_ids(model, tokenizer)
    return model.eval()


@pytest.mark.parametrize("kind, written_out", [("qwen2", True), ("llama-mlp-bias", False)])
def test_other_architectures_decode_as_generate(tiny, kind, written_out):
    """Qwen2 is written out (its q, k, v biases go through the step); a Llama with MLP biases is
    not, and decodes through the model's own forward. Either way, greedy, generate's tokens."""
    _, tokenizer = tiny
    model = tiny_variant(tokenizer, kind)
    assert decode.grouped_step_supported(model) == written_out
    ours, hf = both(model, tokenizer, max_new_tokens=16, num_generations=2, greedy=True)
    assert_same(ours, hf)


PACKING = {
    torch.bfloat16: decode.onednn_has_bf16(),
    torch.float32: torch.backends.mkl.is_available(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_multiply_as_the_modules_and_follow_their_updates(dtype):
    """On a CPU the weights of the decode step are prepacked (MKL in fp32, oneDNN in bf16). A packed
    product must equal the module's own up to the order of the sums: fp32 within 1e-5 relative (64
    products of size ~0.1 summed in another order differ by a few ulps), bf16 within its rounding
    of the output (2^-8 relative; both accumulate in fp32). After the weights change in place (the
    copy's refresh after an optimizer step) or the number of rows changes, they are packed again."""
    if not PACKING[dtype]:
        pytest.skip(f"this CPU's torch has no packed {dtype} matmul: the modules run as they are")
    model, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
    model = decode.sampling_model(model, dtype) if dtype != torch.float32 else model
    packed = decode.packed_for(model, rows=4)
    groups = decode.fused_linears(model)
    assert set(packed) == set(groups)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(id(m) for group in groups for m in group) == sorted(id(m) for m in linears)  # each once
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-3)
    x = torch.randn(4, 1, 64).to(dtype)
    mlp = model.model.layers[0].mlp
    gate_up = (mlp.gate_proj, mlp.up_proj)  # one product of the stacked weights: both outputs side by side

    def separate():
        return torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)

    torch.testing.assert_close(decode.packed_linear(packed[gate_up], x, 4), separate(), **tolerance)
    assert decode.packed_for(model, rows=4) is packed  # nothing changed: not packed again
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)
    again = decode.packed_for(model, rows=4)
    assert again is not packed
    torch.testing.assert_close(decode.packed_linear(again[gate_up], x, 4), separate(), **tolerance)
    assert decode.packed_for(model, rows=1) is not again


def test_prompt_passes_hand_the_lm_head_a_tensor_that_multiplies_as_one_product(tiny):
    """The prefill of decode and the shared prompt pass of completion_logprobs need the logits of
    the last column only. Asked for as logits_to_keep=1, Hugging Face hands the lm_head
    hidden[:, -1:], a view whose batch stride is the prompt's length: torch's matmul cannot fold
    it into one [B, d] product and copies the whole lm_head weight for each prompt (about 170 ms a
    prompt for SmolLM2 in bf16 on a CPU). Every input the lm_head sees must have the strides of a
    fresh tensor of its shape; the values are tested elsewhere (greedy equality with generate,
    shared against plain log-probs)."""
    model, tokenizer = tiny
    seen = []
    handle = model.lm_head.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        out = generation.generate(model, tokenizer, PROMPTS, max_new_tokens=4, num_generations=2, greedy=True)
        assert seen and seen[0].shape == (len(PROMPTS), 1, model.config.hidden_size)  # the prefill
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        generation.completion_logprobs(model, ids, attention, 4, 1.0, share_prompts=True)
    finally:
        handle.remove()
    assert any(x.shape[0] == len(PROMPTS) and x.shape[1] == 1 for x in seen[1:])  # the shared prompt pass
    for x in seen:
        assert x.stride() == torch.empty(x.shape).stride(), (tuple(x.shape), x.stride())


# ---------------------------------------------------------------------------------------------
# K samples of a group: one prefill, its cache copied to the K rows
# ---------------------------------------------------------------------------------------------
def test_one_prefill_per_prompt_samples_what_k_prefills_sample(tiny):
    """The K rows of a prompt start from one prefill, written to K rows of the cache. With the same
    seed they must sample exactly what K separate prefills sample; and the K rows must differ
    (they are K samples, not K copies of one)."""
    model, tokenizer = tiny
    outs = []
    for prefill_once in (True, False):
        torch.manual_seed(3)
        outs.append(
            generation.generate(
                model, tokenizer, PROMPTS, max_new_tokens=12, num_generations=4, prefill_once=prefill_once
            )
        )
    assert torch.equal(outs[0]["completion_ids"], outs[1]["completion_ids"])
    group = outs[0]["completion_ids"][4:8]
    assert len({tuple(row.tolist()) for row in group}) > 1


def test_kv_cache_holds_each_prompt_in_its_k_rows():
    """After the prefill, rows j*K .. j*K+K-1 hold prompt j's keys, and the columns past the prompt
    are still zero (nothing written there yet)."""
    cache = decode.StaticKVCache(rows=6, length=5, repeats=3)
    keys = torch.arange(2 * 1 * 2 * 1, dtype=torch.float32).reshape(2, 1, 2, 1) + 1  # 2 prompts, 2 positions
    returned, _ = cache.update(keys, -keys, layer_idx=0)
    assert torch.equal(returned, keys)  # the prompt attends to its own keys
    stored = cache.keys[0]
    assert stored.shape == (6, 1, 5, 1)
    for row in range(6):
        assert torch.equal(stored[row, :, :2], keys[row // 3])
    assert (stored[:, :, 2:] == 0).all() and torch.equal(cache.values[0][:, :, :2], -stored[:, :, :2])
    cache.column, cache.visible = torch.tensor([2]), 3  # one decode step writes column 2 of every row
    step = torch.full((6, 1, 1, 1), 9.0)
    returned, _ = cache.update(step, step, layer_idx=0)
    assert returned.shape == (6, 1, 3, 1) and (returned[:, :, 2] == 9).all()


# ---------------------------------------------------------------------------------------------
# Sampling: exactly softmax(logits / T) cut by top-p
# ---------------------------------------------------------------------------------------------
# Hand-made probabilities p at T = 1, T = 2 and top_p = 0.75. Tempered, q ∝ sqrt(p) =
# [.277, .219, .170, .139, .107, .088]; the tokens ranked above token 3 hold .666 < .75, above
# token 4 .805: the nucleus is {0, 1, 2, 3}. Two plausible mistakes both lose token 3:
# - temperature after top-p: the nucleus of p itself is {0, 1, 2} (above token 3: .80 >= .75);
# - one token too few (keep while the mass *including* the token is below top_p): {0, 1, 2}.
P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
T, TOP_P = 2.0, 0.75


def nucleus_distribution(p, temperature, top_p):
    """The expected distribution, written out independently: temper, sort, keep while the mass
    above is below top_p, renormalize."""
    q = p ** (1 / temperature)
    q = q / q.sum()
    order = sorted(range(len(q)), key=lambda i: -float(q[i]))
    kept, above = [], 0.0
    for i in order:
        if above >= top_p:
            break
        kept.append(i)
        above += float(q[i])
    out = torch.zeros_like(q)
    out[kept] = q[kept] / q[kept].sum()
    return out


def test_top_p_keeps_the_nucleus_of_the_tempered_distribution():
    logits = P.log() / T
    kept = decode.top_p_filter(logits[None], TOP_P)[0].isfinite()
    assert kept.tolist() == [True, True, True, True, False, False]
    assert decode.top_p_filter(P.log()[None], TOP_P)[0].isfinite().sum() == 3  # untempered: 3
    assert decode.top_p_filter(logits[None], 1.0)[0].isfinite().all()
    assert decode.top_p_filter(logits[None], 0.01)[0].isfinite().sum() == 1  # the best always stays


def assert_follows(counts, expected, draws):
    """Each token's count within 6 binomial standard deviations of draws * p (a false alarm for a
    correct sampler: under 2e-9 per token by the normal approximation, every expected count here
    being >= 100), and never a token of probability 0."""
    for token, (n, p) in enumerate(zip(counts.tolist(), expected.tolist())):
        if p == 0:
            assert n == 0, f"token {token} has probability 0 and was drawn {n} times"
        else:
            sd = math.sqrt(draws * p * (1 - p))
            assert abs(n - draws * p) <= 6 * sd, (token, n, draws * p)


def test_draws_follow_softmax_of_logits_over_t_cut_by_top_p():
    """20,000 draws of next_tokens from the hand-made logits, counted against the exact distribution.
    Token 3 has probability .139 / .805 = .17 (about 3,450 draws): either mistake above draws it
    never, 58 standard deviations from the truth."""
    draws = 20_000
    torch.manual_seed(0)
    tokens, logprobs = decode.next_tokens(P.log().expand(draws, -1), temperature=T, top_p=TOP_P)
    counts = torch.bincount(tokens, minlength=len(P))
    expected = nucleus_distribution(P, T, TOP_P)
    assert expected[3] > 0.15 and expected[4] == 0
    assert_follows(counts, expected, draws)
    assert nucleus_distribution(P, 1.0, TOP_P)[3] == 0 and counts[3] > 3000  # either mistake: caught
    # The sampler's own log-probability of each token is that of the distribution it was drawn from
    # (tempered and cut), not of softmax(logits): log .17 = -1.77 for token 3, where the full softmax
    # of P gives log .139 = -1.97. fp32 softmax and log: a few ulps of error.
    assert torch.allclose(logprobs, expected.log()[tokens], atol=1e-5)
    # T = 0 is the argmax (probability 1); a suppressed token is never drawn, even the best one
    best, best_logprobs = decode.next_tokens(P.log().expand(4, -1), greedy=True)
    assert (best == 0).all() and (best_logprobs == 0).all()
    suppressed, suppressed_logprobs = decode.next_tokens(P.log().expand(2000, -1), suppress=torch.tensor([0]))
    assert (suppressed != 0).all()
    without_best = P.clone().index_fill(0, torch.tensor([0]), 0.0)
    assert torch.allclose(
        suppressed_logprobs, (without_best / without_best.sum()).log()[suppressed], atol=1e-5
    )


def test_inverse_transform_draws_no_zero_probability_token_at_the_extremes(monkeypatch):
    """The draw takes the first token whose cumulative probability reaches u = (1 - U) * total.
    At U's extremes (0 and the largest fp64 below 1) u is the total and 2^-53 of it: the last and
    the first token of positive probability, never one of the zero-probability tokens beside them
    (u = U * total would take token 0, of probability 0, at U = 0)."""
    logits = torch.tensor([[-math.inf, 0.0, -math.inf, 0.0, -math.inf]]).expand(2, -1)
    for uniform, token in ((0.0, 3), (1 - 2**-53, 1)):
        monkeypatch.setattr(
            decode.torch,
            "rand",
            lambda *shape, dtype=None, device=None, u=uniform: torch.full(shape, u, dtype=dtype),
        )
        assert decode.next_tokens(logits)[0].tolist() == [token, token]


def test_first_tokens_of_a_group_follow_the_models_distribution():
    """End to end: one prompt, K = 8,000 samples of one token each (one prefill, its cache copied to
    8,000 rows), against softmax(logits / T) cut by top-p of the model's own logits for that prompt.
    The tiny model's logits are nearly flat (std 0.17), so its head is scaled up 12x to give a
    distribution with a few likely tokens; tokens expected fewer than 100 times are pooled."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    with torch.no_grad():
        model.lm_head.weight.mul_(12)
    temperature, top_p, draws = 0.8, 0.9, 8000
    ids = tokenizer(["Q1: What time does the spa open?"], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    expected = nucleus_distribution(logits.softmax(-1), temperature, top_p)
    torch.manual_seed(1)
    out = decode.decode(
        model, ids, torch.ones_like(ids), 1, [], tokenizer.pad_token_id,
        num_generations=draws, temperature=temperature, top_p=top_p,
    )  # fmt: skip
    counts = torch.bincount(out[:, -1], minlength=len(expected))
    assert 3 <= int((expected > 0).sum()) < len(expected) // 2  # a real cut
    common = expected * draws >= 100
    pooled_counts = torch.cat([counts[common], counts[~common & (expected > 0)].sum()[None]])
    pooled_expected = torch.cat([expected[common], expected[~common].sum()[None]])
    assert (counts[expected == 0] == 0).all()
    assert_follows(pooled_counts, pooled_expected, draws)


# ---------------------------------------------------------------------------------------------
# Copies written in one forward (--recall copy): each row at its own pace, the same tokens
# ---------------------------------------------------------------------------------------------
class OracleCopies:
    """A stand-in for srt/recall.py's CopyRule: a row that has written n tokens, n in `at`, is handed
    the next `sizes[row]` tokens of `reference` (completions [rows, C]) as the program's copy."""

    def __init__(self, reference, sizes, at):
        self.reference, self.sizes, self.at = reference, sizes, at
        self.longest = max(sizes)

    def __call__(self, row, completion):
        n = len(completion)
        return self.reference[row, n : n + self.sizes[row]].tolist() if n in self.at else []


def count_forwards(monkeypatch):
    """The positions a row feeds at each call of the grouped step's multi-position forward."""
    steps = []
    forward = decode.GroupedStep.forward

    def counting(self, tokens, *args):
        steps.append(tokens.shape[1])
        return forward(self, tokens, *args)

    monkeypatch.setattr(decode.GroupedStep, "forward", counting)
    return steps


def copy_and_one_a_step(model, enc, max_new_tokens, stops, rule, **kwargs):
    """decode.decode with copy_rule through the copy loop (grouped) and one token a step (the model's
    own forward): each -> (sequences, logprobs, copied)."""
    inputs = (model, enc.input_ids, enc.attention_mask, max_new_tokens, stops, 0)
    return [
        decode.decode(*inputs, greedy=True, with_logprobs=True, copy_rule=rule, grouped=grouped, **kwargs)
        for grouped in (True, False)
    ]


def assert_same_outputs(a, b):
    for name, x, y in zip(("sequences", "logprobs", "copied"), a, b):
        assert torch.equal(x, y), name


def test_a_copy_steps_logits_are_the_models_own_at_every_position(monkeypatch):
    """Three prompts (left padded), K = 2, rows handed copies of 0 to 3 tokens (the next tokens greedy
    writes) after 1, 5 and 9 tokens, so the rows move on at different paces: every position a step
    computes must give the logits of the model's own forward over that row's unpadded tokens at that
    position, and be fed that position's token. A wrong position, mask or cache column (a row reading
    its sibling's tokens, a copied token not seeing itself) changes the logits by far more than the
    1e-4 allowed here: fp32 throughout, the two differ only in the order of sums (~1e-6 on logits of
    size ~1). Tokens, log-probs and the copied mask are those of the loop that writes the copy one
    token a step."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    tokenizer.padding_side = "left"
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    width, rows = enc.input_ids.shape[1], 6
    free = decode.decode(model, enc.input_ids, enc.attention_mask, 12, [], 0, num_generations=2, greedy=True)
    handed, calls, forward = {}, [], decode.GroupedStep.forward

    class Handing(OracleCopies):  # records each row's copy length until the step that feeds it
        def __call__(self, row, completion):
            handed[row] = len(super().__call__(row, completion))
            return super().__call__(row, completion)

    def recording(self, tokens, positions, *args):
        logits = forward(self, tokens, positions, *args)
        calls.append((tokens.clone(), positions.clone(), logits.clone(), dict(handed)))
        handed.clear()
        return logits

    monkeypatch.setattr(decode.GroupedStep, "forward", recording)
    rule = Handing(free[:, width:], sizes=[r % 4 for r in range(rows)], at={1, 5, 9})
    copying, one_a_step = copy_and_one_a_step(model, enc, 12, [], rule, num_generations=2)
    assert_same_outputs(copying, one_a_step)
    assert torch.equal(copying[0], free) and max(t.shape[1] for t, _, _, _ in calls) == 4
    copied = copying[2]
    assert copied[3, 1:4].all() and copied[3, 5:8].all() and not copied[0].any()  # sizes 3 and 0
    assert (copying[1][copied] == 0).all()
    prompt_real = enc.attention_mask.repeat_interleave(2, 0).bool()
    real = torch.cat([prompt_real, torch.ones(rows, 12, dtype=torch.bool)], 1)
    checked = 0
    for row in range(rows):
        tokens_of_row = free[row][real[row]]
        with torch.no_grad():
            own = model(input_ids=tokens_of_row[None]).logits[0]
        for tokens, positions, logits, copies in calls:
            for j in range(copies.get(row, 0) + 1):  # the row's last token, then its copy
                position = int(positions[row, j])
                if position < len(tokens_of_row) - 1:
                    assert tokens[row, j] == tokens_of_row[position]
                    torch.testing.assert_close(logits[row, j], own[position], rtol=0, atol=1e-4)
                    checked += 1
    assert checked > 50


def test_a_copy_is_written_in_one_forward_and_cut_at_max_new_tokens(monkeypatch):
    """One row, 12 tokens, a copy of 3 handed after the first token, one of 5 after the 9th (the
    next tokens greedy writes, of 16): the first copy and the token drawn after it take one
    forward (12 tokens: the prefill's, then 6 steps); the second is cut at max_new_tokens, where
    one token a step cuts it, and no token is drawn after it."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    enc = tokenizer([PROMPTS[1]], return_tensors="pt", add_special_tokens=False)
    width = enc.input_ids.shape[1]
    free = decode.decode(model, enc.input_ids, enc.attention_mask, 16, [], 0, greedy=True)
    sizes = {1: 3, 9: 5}

    class Rule:
        longest = 5

        def __call__(self, row, completion):
            n = len(completion)
            return free[row, width + n : width + n + sizes.get(n, 0)].tolist()

    steps = count_forwards(monkeypatch)
    copying, one_a_step = copy_and_one_a_step(model, enc, 12, [], Rule())
    assert_same_outputs(copying, one_a_step)
    assert torch.equal(copying[0], free[:, : width + 12]) and steps == [4, 1, 1, 1, 1, 4]
    assert copying[2][0].tolist() == [False] + [True] * 3 + [False] * 5 + [True] * 3


def test_a_copy_that_holds_a_stop_token_ends_the_row_there():
    """Row 0 is handed the next 4 tokens greedy writes after its first; the 4th token written (the
    copy's third) is planted as a stop token: the row must end on it, the rest of the copy dropped,
    as one token a step ends it."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    tokenizer.padding_side = "left"
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    width = enc.input_ids.shape[1]
    free = decode.decode(model, enc.input_ids, enc.attention_mask, 12, [], 0, greedy=True)
    stop = int(free[0, width + 3])
    rule = OracleCopies(free[:, width:], sizes=[4, 0, 0], at={1})
    copying, one_a_step = copy_and_one_a_step(model, enc, 12, [stop], rule)
    assert_same_outputs(copying, one_a_step)
    sequences, _, copied = copying
    assert sequences[0, width + 3] == stop and (sequences[0, width + 4 :] == 0).all()
    assert copied[0].tolist()[:5] == [False, True, True, True, False]


def test_the_token_after_a_copy_follows_the_models_distribution():
    """End to end: one prompt, K = 8,000 rows, 4 tokens each, every row handed the copy (x, y) after
    its first token (x, y the likeliest tokens after the likeliest first token t1 and then x). The
    4th token of the rows that began with t1 must follow p(. | prompt, t1, x, y): the logits at the
    copy's last token, through the step's mask, positions and cache columns, are the model's."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked: p(t1) ~.38, so ~3,000 rows begin with t1
    temperature, top_p, draws = 0.8, 0.9, 8000
    ids = tokenizer(["Q1: What time does the spa open?"], return_tensors="pt").input_ids

    def next_distribution(*tokens):
        with torch.no_grad():
            after = torch.tensor([tokens], dtype=torch.long)
            logits = model(input_ids=torch.cat([ids, after], 1)).logits[0, -1]
        return nucleus_distribution(logits.softmax(-1), temperature, top_p)

    first = next_distribution().argmax().item()
    x = next_distribution(first).argmax().item()
    y = next_distribution(first, x).argmax().item()

    class Rule:
        longest = 2

        def __call__(self, row, completion):
            return [x, y] if len(completion) == 1 else []

    torch.manual_seed(2)
    out, logprobs, copied = decode.decode(
        model, ids, torch.ones_like(ids), 4, [], tokenizer.pad_token_id, num_generations=draws,
        temperature=temperature, top_p=top_p, with_logprobs=True, copy_rule=Rule(),
    )  # fmt: skip
    completions = out[:, ids.shape[1] :]
    assert completions.shape == (draws, 4) and (completions[:, 1:3] == torch.tensor([x, y])).all()
    assert copied[:, 1:3].all() and (logprobs[:, 1:3] == 0).all() and not copied[:, [0, 3]].any()
    rows = completions[:, 0] == first
    expected = next_distribution(first, x, y)
    counts = torch.bincount(completions[rows, 3], minlength=len(expected))
    n = int(rows.sum())
    assert n > 2000, n
    common = expected * n >= 100
    pooled_counts = torch.cat([counts[common], counts[~common & (expected > 0)].sum()[None]])
    pooled_expected = torch.cat([expected[common], expected[~common].sum()[None]])
    assert (counts[expected == 0] == 0).all()
    assert_follows(pooled_counts, pooled_expected, n)
    assert torch.allclose(logprobs[rows, 3], expected.log()[completions[rows, 3]], atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Generation weights: a bf16 copy where the hardware has bf16 units
# ---------------------------------------------------------------------------------------------
def test_sampling_copy_is_bf16_keeps_fp32_buffers_and_refreshes_when_the_weights_change():
    """The copy is made once, reused while the masters are unchanged (no copy, so no repacking),
    refreshed after an in-place change (a version counter moves), and after any optimizer's step
    (the hook the sampling path registers) even where the step moves no version counter (a fused
    AdamW): then the packed weights of an fp32 model, the model's own, are packed again as well."""
    model, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
    assert decode.sampling_model(model, None) is model  # no bf16 units: fp32, the model itself
    low = decode.sampling_model(model, torch.bfloat16)
    assert low is not model and not low.training
    assert {p.dtype for p in low.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the masters stay fp32
    assert all(b.dtype == torch.float32 for b in low.buffers() if b.is_floating_point())  # RoPE's inv_freq

    def matches():
        return all(torch.equal(q, p.to(torch.bfloat16)) for p, q in zip(model.parameters(), low.parameters()))

    copied = decode.weight_versions(low)
    assert decode.sampling_model(model, torch.bfloat16) is low and decode.weight_versions(low) == copied
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert not matches()
    assert decode.sampling_model(model, torch.bfloat16) is low and matches()

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    packed = decode.packed_for(model, rows=2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert not matches()
    assert decode.sampling_model(model, torch.bfloat16) is low and matches()
    assert decode.packed_for(model, rows=2) is not packed


def test_generate_samples_from_the_bf16_copy_and_hooks_see_it(tiny):
    """generation.generate(autocast_dtype=bf16), as stage 2 calls it on a GPU or an AMX CPU: the
    decode runs on the copy (its matmuls in bf16, no autocast), and a forward hook registered on
    the model before the copy was made fires on the copy (bench/grpo_workers.py reads precision so)."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    seen = []
    model.model.layers[-1].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = generation.generate(
        model, tokenizer, PROMPTS[:2], max_new_tokens=6, greedy=True, autocast_dtype=torch.bfloat16
    )
    assert seen and set(seen) == {torch.bfloat16}
    low = decode.sampling_model(model, torch.bfloat16)
    reference = copy.deepcopy(model).to(torch.bfloat16)
    assert all(torch.equal(p, q) for p, q in zip(low.parameters(), reference.parameters()))
    again = generation.generate(low, tokenizer, PROMPTS[:2], max_new_tokens=6, greedy=True)
    assert torch.equal(out["completion_ids"], again["completion_ids"])


def test_rollouts_decoded_in_inference_mode_train_the_policy():
    """generate decodes in inference mode, whose tensors autograd refuses to save for a backward
    pass. What stage 2 does next must still work: embed the returned completion ids in a training
    forward and backpropagate (an embedding saves its ids), step the optimizer, and sample again
    from the refreshed bf16 copy (an in-place copy into an inference tensor would be refused)."""
    model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    out = generation.generate(
        model, tokenizer, PROMPTS, max_new_tokens=6, num_generations=2, autocast_dtype=torch.bfloat16
    )
    for key in ("prompt_ids", "completion_ids", "completion_mask"):
        assert not out[key].is_inference(), key
    model.train()
    model(input_ids=out["completion_ids"]).logits.float().logsumexp(-1).mean().backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0
    optimizer.step()
    low = decode.sampling_model(model, torch.bfloat16)  # refreshed in place from the new weights
    assert all(torch.equal(q, p.to(torch.bfloat16)) for p, q in zip(model.parameters(), low.parameters()))
    again = generation.generate(
        model, tokenizer, PROMPTS, max_new_tokens=6, greedy=True, autocast_dtype=torch.bfloat16
    )
    assert again["completion_ids"].shape == (3, 6)


def test_unknown_engine_and_empty_budget_are_refused(tiny):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="engine"):
        generation.generate(model, tokenizer, ["Hello"], engine="vllm")
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode.decode(model, torch.tensor([[5]]), torch.tensor([[1]]), 0, [], 0)


# ---------------------------------------------------------------------------------------------
# bench/rollout_speed.py
# ---------------------------------------------------------------------------------------------
def load_bench():
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))  # the benchmark imports its neighbour measure.py
    spec = importlib.util.spec_from_file_location("rollout_speed", bench / "rollout_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rollout_speed_smoke_equal_work_precision_and_greedy_check(tmp_path):
    import json

    from records import hand_record

    from srt.data_io import write_jsonl

    data = tmp_path / "records.jsonl"
    write_jsonl(data, [hand_record(i) for i in range(3)])
    bench = load_bench()
    out = tmp_path / "out"  # a folder of the benchmark's own: one holding the data would be refused
    common = ["--model", "tiny-random", "--data", str(data), "--out", str(out), "--max-new-tokens", "4"]
    bench.main(common + ["--ks", "1,3", "--prompts", "2", "--repeats", "1", "--precision", "fp32"])
    result = json.loads((out / "results.json").read_text())
    assert [r["K"] for r in result["runs"]] == [1, 3]
    for run in result["runs"]:  # every row exactly 4 tokens on both sides, fp32 read from the matmuls
        assert run["ours"]["generated_tokens"] == run["hf"]["generated_tokens"] == 2 * run["K"] * 4
        assert run["precision"] == {"ours": ["torch.float32"], "hf": ["torch.float32"]}
        assert run["speedup"] > 0
        assert run["cpu_ratio"] == run["cpu"]["hf"]["median"] / run["cpu"]["ours"]["median"] > 0
        assert bench.FREE not in run and "copies_paired" not in run
    graph = "replayed" if torch.cuda.is_available() else "n/a"
    assert [run["cuda_graph"] for run in result["runs"]] == [graph, graph]
    bench.main(common + ["--check", "--check-prompts", "3", "--batch-size", "2"])
    check = json.loads((out / "check.json").read_text())
    assert check["equal"] is True and check["prompts"] == 3 and check["tokens"] > 0
    # --recall copy: ours by pointer and ours free, paired; generate cannot copy, so no ratio to it
    bench.main(common + ["--ks", "2", "--repeats", "1", "--precision", "fp32", "--recall", "copy"])
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["recall"] == "copy" and run["speedup"] is None and "hf" not in run
    free = run[bench.FREE]  # the same work in the same repeat
    assert free["generated_tokens"] == run["ours"]["generated_tokens"] == 2 * 4  # 1 prompt x K = 2
    assert run["copies_paired"]["median"] == free["seconds"]["median"] / run["ours"]["seconds"]["median"]
    assert run["copied_tokens"]["ours"]["median"] == 0  # a random model writes no tags


def test_rollout_speed_reads_the_cuda_graph_fallback_from_decodes_own_warning(monkeypatch):
    """On a GPU the bench reports whether our rollouts replayed the decode step as a CUDA graph. It
    reads the warning decode.capture_step gives when it falls back to eager decoding: a capture that
    fails here (no CUDA on a CPU, or a broken step on a GPU) must give a warning the bench counts."""
    bench = load_bench()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # a CPU-only torch has nothing to sync

    def broken_step():
        raise RuntimeError("not capturable")

    with pytest.warns(UserWarning) as caught:
        assert decode.capture_step(broken_step) == (None, None)
    assert str(caught[0].message).startswith(bench.GRAPH_FAILED)
    assert bench.graph_record("cuda", [False, False, False]) == "replayed"
    assert bench.graph_record("cuda", [False, True, False]) == "failed in 1 of 3 rollouts"
    assert bench.graph_record("cpu", [False]) == "n/a"


def test_gpu_rollouts_script_runs_end_to_end_on_a_cpu_from_an_exported_shape(tmp_path):
    """bench/gpu_rollouts.sh is what a GPU machine runs in one go, so it must not first fail there: on
    a CPU (CPU_SMOKE) it exports tiny-random's shape (config and tokenizer, no weights), gives it
    random weights, times both engines at K = 1, 4, 8 and finds the greedy tokens equal."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from records import hand_record

    from srt.data_io import write_jsonl

    root = Path(__file__).resolve().parents[1]
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "dev"):
        write_jsonl(data / f"{split}.jsonl", [hand_record(i) for i in range(3)])
    work = tmp_path / "work"
    env = dict(os.environ, PYTHON=sys.executable, MODEL="tiny-random", DATA=str(data), WORK=str(work))
    script = ["bash", str(root / "bench" / "gpu_rollouts.sh")]
    shape = tmp_path / "shape"
    subprocess.run(script, env=dict(env, EXPORT_SHAPE=str(shape)), check=True, capture_output=True)
    assert (shape / "config.json").exists() and (shape / "tokenizer.json").exists()
    assert not list(shape.glob("*.safetensors"))  # the shape travels without weights
    smoke = dict(env, CPU_SMOKE="1", SHAPE=str(shape), TOKENS="3", REPEATS="1", CHECK_PROMPTS="2")
    smoke["PRECISION"] = "fp32"  # the suite runs fp32 on every CPU (conftest.py)
    out = subprocess.run(script, env=smoke, check=True, capture_output=True, text=True).stdout
    assert "FAILED" not in out
    assert (work / "model" / "model.safetensors").exists()
    speed = json.loads((work / "speed" / "results.json").read_text())
    assert [r["K"] for r in speed["runs"]] == [1, 4, 8]
    for run in speed["runs"]:  # every row 3 tokens; no CUDA graph off a GPU
        assert run["ours"]["generated_tokens"] == run["hf"]["generated_tokens"] == run["K"] * 3
        assert run["cuda_graph"] == "n/a"
    for check in ("check", "check-tiny"):
        result = json.loads((work / check / "check.json").read_text())
        assert result["equal"] is True and result["prompts"] == 2
