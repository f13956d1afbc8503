"""GRPO's loss in every corner, and its family (--loss-type grpo | dapo | dr_grpo, --scale-rewards
group | batch | none) against hand-computed values: masked tokens that hold -inf, the token count of a
batch spread over two ranks, the importance weight kept out of the KL term, and the length bias each
normalisation has or has not, on one rank and on two under gloo."""

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from grpo_records import hand_experience, hand_loss, run_step
from test_fsdp import fixed_rollouts
from test_rollout import sharp_tiny
from test_stage2 import config

import stage2_grpo as g
from srt.loading import load_model_and_tokenizer
from srt.rollouts import Rollout

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# A masked token may hold anything: never NaN in the gradient
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", g.LOSS_TYPES)
def test_a_masked_minus_inf_or_overflowing_logprob_leaves_the_gradient_finite(loss_type):
    """Row [-1, -2, x] whose last token is masked (padding, or a suppressed pad id): with x = -inf the
    ratio is exp(nan) there, and with x = -100 against pi_ref 0, k3 overflows to inf. Masking after
    exp and k3 put 0 * inf = NaN into the masked token's gradient; the valid ones get -A w each."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weight = {"grpo": 1 / 2, "dapo": 1 / 2, "dr_grpo": 1 / 3}[loss_type]  # 1/(|o| G), 1/N, 1/(G L)
    for masked, ref_there in ((-math.inf, -math.inf), (-100.0, 0.0)):
        logprobs = torch.tensor([[-1.0, -2.0, masked]], requires_grad=True)
        ref = torch.tensor([[-1.0, -2.0, ref_there]])
        loss, stats = hand_loss(
            logprobs,
            logprobs.detach(),
            ref,
            torch.tensor([1.0]),
            mask,
            beta=0.04,
            loss_type=loss_type,
            is_weights=torch.tensor([[1.0, 1.0, math.inf]]),  # pi_old / pi_sampler overflowed there
        )
        loss.backward()
        assert torch.isfinite(loss) and stats["kl"] == 0.0 and stats["ratio"] == 1.0
        assert logprobs.grad[0].tolist() == pytest.approx([-weight, -weight, 0.0], abs=1e-7)


def test_an_update_whose_padding_is_a_suppressed_token_skips_nothing(monkeypatch):
    """bench/grpo_vs_trl.py puts the pad id into suppress_tokens: the log-probs of a row's padding,
    after its stop token, are then -inf. Every minibatch holding a row that stopped early used to be
    skipped as 'non-finite' (skipped 1, updates 0) though its loss was finite."""
    rollouts = fixed_rollouts()
    monkeypatch.setattr(g, "generate", rollouts["fixed_generate"])
    policy, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    ref, _ = load_model_and_tokenizer("tiny-random", dtype="float32")
    policy.generation_config.suppress_tokens = [tokenizer.pad_token_id]
    cfg = config("-K", "4", "--sample-ratio", "2", "--mu", "2", "--beta", "0.04", "--lr", "1e-3")
    before = [p.detach().clone() for p in policy.parameters()]
    result = run_step(
        policy,
        ref,
        tokenizer,
        torch.optim.SGD(policy.parameters(), lr=1e-3),
        [None],
        [rollouts["PROMPTS"][0]],
        cfg,
        reward_fn=rollouts["toy_reward"],
    )
    assert (result.skipped_updates, result.updates) == (0, 4)  # 2 minibatches x mu = 2
    assert math.isfinite(result.loss) and math.isfinite(result.grad_norm)
    assert any(not torch.equal(b, p) for b, p in zip(before, policy.parameters()))


# ---------------------------------------------------------------------------------------------
# Mutations the suite must catch
# ---------------------------------------------------------------------------------------------
def test_the_importance_weight_multiplies_the_surrogate_and_never_the_kl():
    """Advantage 0: the surrogate is 0, so the loss is beta times the KL alone, whatever the
    importance weights. A weight multiplied into the KL term would double this loss."""
    logprobs = torch.zeros(1, 2)
    ref = torch.log(torch.tensor([[0.5, 2.0]]))
    k3 = [0.5 - math.log(0.5) - 1, 2.0 - math.log(2.0) - 1]  # r - log r - 1, r = pi_ref / pi
    weights = torch.full((1, 2), 2.0)
    for is_weights in (None, weights):
        loss, stats = hand_loss(
            logprobs, logprobs, ref, torch.zeros(1), torch.ones(1, 2), beta=0.5, is_weights=is_weights
        )
        assert loss.item() == pytest.approx(0.5 * sum(k3) / 2, rel=1e-6)
        assert stats["kl"] == pytest.approx(sum(k3) / 2, rel=1e-6)
    # and it does weigh the surrogate: A = 1 on policy, w = 2 -> loss -2 (plus the same KL)
    loss, _ = hand_loss(
        logprobs, logprobs, ref, torch.ones(1), torch.ones(1, 2), beta=0.5, is_weights=weights
    )
    assert loss.item() == pytest.approx(-2.0 + 0.5 * sum(k3) / 2, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# The family: hand values
# ---------------------------------------------------------------------------------------------
def test_dr_grpo_divides_by_completions_times_the_maximum_length():
    """mask [[1, 0, 0], [1, 1, 1]], A = [1, -1], on policy: the sum of the terms is 1 - 3 = -2, so
    loss = 2 / (G L): 1/3 with L = C = 3, 1/10 with L = --max-new-tokens 10; every token's gradient
    is -A / (G L)."""
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    for L, want in ((None, 1 / 3), (10, 1 / 10)):
        logprobs = torch.zeros(2, 3, requires_grad=True)
        loss, _ = hand_loss(
            logprobs, logprobs.detach(), None, torch.tensor([1.0, -1.0]), mask, beta=0.0,
            loss_type="dr_grpo", max_new_tokens=L,
        )  # fmt: skip
        loss.backward()
        assert loss.item() == pytest.approx(want)
        w = want / 2
        assert logprobs.grad.flatten().tolist() == pytest.approx([-w, 0.0, 0.0, w, w, w])


def test_scale_rewards_group_batch_none_by_hand():
    """Groups [1, 2, 3] and [0, 0, 6], both of mean 2. group: each group's population std, sqrt(2/3)
    and sqrt(8); batch: the std of all six, sqrt(26/6); none: R - mean R (Dr. GRPO)."""
    rewards = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 6.0]])
    deviations = [[-1.0, 0.0, 1.0], [-2.0, -2.0, 4.0]]
    group = g.group_advantages(rewards, scale="group")
    assert group[0].tolist() == pytest.approx([d / math.sqrt(2 / 3) for d in deviations[0]], rel=1e-6)
    assert group[1].tolist() == pytest.approx([d / math.sqrt(8) for d in deviations[1]], rel=1e-6)
    batch = g.group_advantages(rewards, scale="batch")
    want = [d / math.sqrt(26 / 6) for row in deviations for d in row]
    assert batch.flatten().tolist() == pytest.approx(want, rel=1e-6)
    assert g.group_advantages(rewards, scale="none").tolist() == deviations
    # another rank's groups enter the batch std
    wider = g.group_advantages(rewards, scale="batch", batch_rewards=torch.tensor([1, 2, 3, 0, 0, 6, 2, 2.0]))
    assert wider[0, 0].item() == pytest.approx(-1 / math.sqrt(26 / 8), rel=1e-6)
    # An all-equal group stays exactly 0 under each: its float64 mean (Rollout.rewards) can miss by an ulp
    # (three 0.1s average to 0.10000000000000002), and that ulp over 1e-8 would be 1e-9, not 0.
    for scale in g.SCALE_REWARDS:
        for value, K in ((0.3, 4), (0.1, 3), (2.2, 7), (0.7, 3)):
            flat = g.group_advantages(torch.full((1, K), value, dtype=torch.float64), scale=scale)
            assert torch.equal(flat, torch.zeros(1, K)), (scale, value, K)


def test_the_flags_name_the_family():
    assert (config().loss_type, config().scale_rewards) == ("grpo", "group")  # the paper: Eq. (8), (9)
    assert config("--loss-type", "dr_grpo").scale_rewards == "none"  # Dr. GRPO: no std
    assert config("--loss-type", "dr_grpo", "--scale-rewards", "batch").scale_rewards == "batch"
    assert {"loss_type", "scale_rewards"} <= set(g.RESUME_MUST_MATCH)
    help_text = g.build_parser().format_help()
    assert (
        "--loss-type {grpo,dapo,dr_grpo}" in help_text and "--scale-rewards {group,batch,none}" in help_text
    )


# ---------------------------------------------------------------------------------------------
# The length bias, numerically: one rank, and two ranks under gloo
# ---------------------------------------------------------------------------------------------
SHORT, LONG, MAX_LENGTH = 4, 20, 32
# Per-token gradient magnitude of a short and a long completion with the same advantage (A = 1),
# G = 2 completions, N = 24 tokens: grpo 1/(|o| G), dapo 1/N, dr_grpo 1/(G L).
EXPECTED_WEIGHTS = {
    "grpo": (1 / (SHORT * 2), 1 / (LONG * 2)),  # ratio 5: the short completion's tokens weigh more
    "dapo": (1 / 24, 1 / 24),
    "dr_grpo": (1 / (2 * MAX_LENGTH), 1 / (2 * MAX_LENGTH)),
}


def padded_logprobs(theta, lengths, offset=0):
    """Completions of `lengths` reading the shared weights theta from `offset`, padded with -inf to
    LONG -> (log-probs [B, LONG], policy mask)."""
    rows, start = [], offset
    for n in lengths:
        rows.append(torch.cat([theta[start : start + n], torch.full((LONG - n,), -math.inf)]))
        start += n
    logprobs = torch.stack(rows)
    return logprobs, (logprobs > -math.inf).float()


def token_gradients(lengths, loss_type, offset=0):
    """Each token's weight in the step's objective, measured as update() makes it: the completions of
    `lengths` read shared weights theta (one per token of the whole batch, SHORT + LONG of them, this
    rank's from `offset`), their log-probs are theta with -inf on the padding, the loss weights take
    the all-ranks token count and the world size, and on several ranks the gradients are averaged as
    DDP does. -> -d loss / d theta, the weight of each token (A = 1)."""
    theta = torch.zeros(SHORT + LONG, requires_grad=True)
    logprobs, mask = padded_logprobs(theta, lengths, offset)
    loss, _ = hand_loss(
        logprobs,
        logprobs.detach(),
        None,
        torch.ones(len(lengths)),
        mask,
        beta=0.0,
        loss_type=loss_type,
        all_rank_tokens=g.all_ranks_tokens(mask) if loss_type == "dapo" else None,
        world_size=g.world_size(),
        max_new_tokens=MAX_LENGTH,
    )
    loss.backward()
    grad = theta.grad
    if dist.is_initialized():  # DDP / FSDP: the gradients' mean over ranks
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    return -grad


def weights_of(token_weights):
    """(the short completion's token weights, the long one's): theta[:SHORT], theta[SHORT:]."""
    return token_weights[:SHORT], token_weights[SHORT:]


@pytest.mark.parametrize("loss_type", g.LOSS_TYPES)
def test_length_bias_on_one_rank(loss_type):
    short, long = weights_of(token_gradients([SHORT, LONG], loss_type))
    want_short, want_long = EXPECTED_WEIGHTS[loss_type]
    assert short.tolist() == pytest.approx([want_short] * SHORT, rel=1e-6)
    assert long.tolist() == pytest.approx([want_long] * LONG, rel=1e-6)
    ratio = short[0].item() / long[0].item()
    assert ratio == pytest.approx({"grpo": LONG / SHORT, "dapo": 1.0, "dr_grpo": 1.0}[loss_type])


def two_rank_worker(rank, init_file, results, weights=token_gradients):
    """One gloo rank: `weights`(lengths, loss_type, offset=...) for each loss type, into results."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        for loss_type in g.LOSS_TYPES:  # rank 0 holds the short completion, rank 1 the long one
            lengths, offset = ([SHORT], 0) if rank == 0 else ([LONG], SHORT)
            results[f"{rank}:{loss_type}"] = weights(lengths, loss_type, offset=offset).tolist()
    finally:
        dist.destroy_process_group()


def test_length_bias_and_token_normalisation_on_two_ranks_under_gloo():
    """The short completion on rank 0 (4 tokens), the long one on rank 1 (20): dapo must weigh every
    token 1/24 (each rank's own count gave 1/8 and 1/40 after DDP's mean); grpo keeps Eq. (9)'s ratio
    of 5 and dr_grpo 1, the same weights as one rank holding both."""
    with tempfile.TemporaryDirectory() as folder:
        results = mp.Manager().dict()
        mp.spawn(two_rank_worker, args=(os.path.join(folder, "init"), results), nprocs=2, join=True)
        for loss_type, (want_short, want_long) in EXPECTED_WEIGHTS.items():
            for rank in (0, 1):  # after the all-reduce both ranks hold the same gradient
                short, long = weights_of(torch.tensor(results[f"{rank}:{loss_type}"]))
                assert short.tolist() == pytest.approx([want_short] * SHORT, rel=1e-6), loss_type
                assert long.tolist() == pytest.approx([want_long] * LONG, rel=1e-6), loss_type


# ---------------------------------------------------------------------------------------------
# A student's walk through one step: the files it enters
# ---------------------------------------------------------------------------------------------
# sample: generation.generate; reward: reward.py; advantages, loss, optimizer step: stage2_grpo.py, with
# the Rollout record of srt/rollouts.py, the log-probs from generation.completion_logprobs and the
# rank-aware wrappers of srt/distributed.py
STEP_FILES = {"stage2_grpo.py", "srt/rollouts.py", "srt/generation.py", "reward.py", "srt/distributed.py"}


def test_one_grpo_step_walks_through_at_most_five_files_of_its_own():
    """sample -> reward -> advantages -> loss -> optimizer step, followed call by call from grpo_step
    on one process: the project's files whose functions a function of stage2_grpo.py calls (what a
    reader steps into from the step) are at most five, and which they are. One level further are the
    decode loop (under generation.generate) and the tag parser and metrics (under reward.py), where a
    reader may stop; the sampler is there, one hop below the step's own sampling call. torch calls
    back two functions of ours: its optimizer, after its step, srt/decode.py's, which marks the
    sampling copy stale; its backward, srt/logprobs.py's chunk of log-probs, recomputed under
    activation checkpointing. Hooks, not calls the reader steps into, so they are listed on their own."""
    import sys
    from pathlib import Path

    from test_stage2 import make_record

    repo = Path(g.__file__).resolve().parent
    policy, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
    cfg = config("-K", "2", "--max-new-tokens", "6", "--sample-ratio", "1", "--beta", "0.04")
    entered, depth_below_step = {}, []  # file -> fewest calls below a function of stage 2

    def own(frame):
        path = Path(frame.f_code.co_filename).resolve()
        skipped = {"tests", ".venv", "site-packages"}
        outside = frame.f_code.co_filename.startswith("<") or not path.is_relative_to(repo)
        outside = outside or bool(skipped & set(path.parts))
        return None if outside else path.relative_to(repo).as_posix()

    hooks = set()  # project functions torch calls back: not a call the reader follows
    calls_back = ("/torch/optim/", "/torch/utils/checkpoint.py")  # the optimizer, a recompute in backward

    def profile(frame, event, arg):
        if event == "call":
            name = own(frame)
            caller = depth_below_step[-1] if depth_below_step else None
            called_by = Path(frame.f_back.f_code.co_filename).as_posix() if frame.f_back else ""
            if name and any(source in called_by for source in calls_back):
                hooks.add(name)
                depth = None
            elif name == "stage2_grpo.py":
                depth = 0
            elif caller is None:
                depth = None
            else:
                depth = caller + 1 if name else caller
            depth_below_step.append(depth)
            if name and depth is not None:
                entered[name] = min(depth, entered.get(name, depth))
        elif event == "return" and depth_below_step:
            depth_below_step.pop()

    sys.setprofile(profile)
    try:
        optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)
        run_step(policy, policy, tokenizer, optimizer, [make_record(0)], ["Hello"], cfg)
    finally:
        sys.setprofile(None)
    walk = {name for name, depth in entered.items() if depth <= 1}
    assert walk == STEP_FILES and len(walk) <= 5, sorted(walk)
    # The sampler's hook marking its bf16 copy stale after the optimizer's step, and the log-probs of
    # a chunk recomputed in the backward.
    assert hooks == {"srt/decode.py", "srt/logprobs.py"}
    assert entered["srt/decode.py"] == 2  # the sampler: generation.generate's one call below the step


# ---------------------------------------------------------------------------------------------
# Eq. (9)'s normalisation is written once: loss_weights
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", g.LOSS_TYPES)
def test_the_loss_is_minus_the_weighted_sum_of_its_terms_with_the_one_table_of_weights(loss_type):
    """Random off-policy log-probs, a KL, importance weights and completions of 5, 2 and 0 policy
    tokens: grpo_loss is -sum(loss_weights * objective) to float rounding (1e-6 relative: a sum of
    15 float32 products), and the weights are the table's: grpo 1/(|o_i| G) (a row sums to 1/G, the
    empty row to 0), dapo 1/N (the batch sums to 1), dr_grpo 1/(G L)."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    logprobs, old, ref = -torch.rand(3, 5) * 2, -torch.rand(3, 5) * 2, -torch.rand(3, 5) * 2
    record = hand_experience(old, ref, torch.tensor([1.0, -0.5, 2.0]), mask, loss_type, max_new_tokens=8,
                             is_weights=torch.rand(3, 5) + 0.5)  # fmt: skip
    loss, terms = g.grpo_loss(logprobs, record, clip_eps=0.2, beta=0.1)
    assert loss.item() == pytest.approx(-(record.loss_weights * terms.objective).sum().item(), rel=1e-6)
    weights = record.loss_weights
    assert (weights[mask == 0] == 0).all()
    if loss_type == "grpo":
        assert weights.sum(1).tolist() == pytest.approx([1 / 3, 1 / 3, 0.0])
        assert weights[1, 0].item() == pytest.approx(1 / (2 * 3))
    elif loss_type == "dapo":
        assert weights[mask > 0].tolist() == pytest.approx([1 / 7] * 7)
    else:
        assert weights[mask > 0].tolist() == pytest.approx([1 / (3 * 8)] * 7)
    assert set(g.LOSS_TYPES) == {"grpo", "dapo", "dr_grpo"}
    with pytest.raises(ValueError, match="unknown loss_type"):
        g.loss_weights(mask, "token", 8)


# ---------------------------------------------------------------------------------------------
# --scale-rewards batch: the group's mean, the whole step's std, every rank's groups
# ---------------------------------------------------------------------------------------------
BATCH_GROUPS = [[1.0, 2.0, 3.0], [4.0, 4.0, 7.0]]  # group means 2 and 5; the batch's 3.5
BATCH_STD = math.sqrt(21.5 / 6)  # population std of all six rewards


def batch_scaled(rows):
    """A~ of --scale-rewards batch by hand: each group's own mean, the std of all six."""
    return [[(r - sum(row) / len(row)) / BATCH_STD for r in row] for row in rows]


def test_batch_scaling_centres_each_group_on_its_own_mean():
    """Groups of different means: a batch scaling that subtracted the batch's mean (3.5) instead
    of each group's would give the first group all-negative advantages."""
    advantages = g.group_advantages(torch.tensor(BATCH_GROUPS), scale="batch")
    assert advantages.tolist() == [pytest.approx(row, rel=1e-6) for row in batch_scaled(BATCH_GROUPS)]
    assert advantages.sum(1).tolist() == pytest.approx([0.0, 0.0], abs=1e-6)


def scored_rollout(rows):
    """A Rollout whose only content is its rewards: groups of K = 3, sequence credit."""
    scores = [{"total": r} for row in rows for r in row]
    empty = torch.zeros(len(scores), 1, dtype=torch.long)
    return Rollout(empty, empty, empty, empty, empty, None, [""] * len(scores), [{}] * len(scores), scores, 3)


def batch_scaling_worker(rank, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        settings = g.StepSettings.of(config("--scale-rewards", "batch", "-K", "3"))
        advantages = g.rollout_advantages(scored_rollout([BATCH_GROUPS[rank]]), None, settings, "cpu")
        results[rank] = advantages.view(-1).tolist()
    finally:
        dist.destroy_process_group()


def test_batch_scaling_reads_every_ranks_rewards_under_gloo():
    """Rank 0 holds the group [1, 2, 3], rank 1 [4, 4, 7]: each rank's advantages divide by the std
    of all six, as one process holding both gets; a rank's own std (sqrt(2/3) and sqrt(2)) would
    give other numbers."""
    one_process = g.rollout_advantages(
        scored_rollout(BATCH_GROUPS),
        None,
        g.StepSettings.of(config("--scale-rewards", "batch", "-K", "3")),
        "cpu",
    )
    assert one_process.view(2, 3).tolist() == [pytest.approx(r, rel=1e-6) for r in batch_scaled(BATCH_GROUPS)]
    with tempfile.TemporaryDirectory() as folder:
        results = mp.Manager().dict()
        mp.spawn(batch_scaling_worker, args=(os.path.join(folder, "init"), results), nprocs=2, join=True)
        for rank in (0, 1):
            assert results[rank] == pytest.approx(batch_scaled(BATCH_GROUPS)[rank], rel=1e-6), rank


# ---------------------------------------------------------------------------------------------
# The experience: pi_old on the loss's own micro-batches, weights per minibatch, filled once
# ---------------------------------------------------------------------------------------------
def experience_and_updates(monkeypatch, *flags, lr=0.0, autocast_dtype=None):
    """A step on fixed rollouts (two prompts, K = 4, completions of different lengths) -> (the
    Experience, the UpdateStats, every completion_logprobs call as (grad enabled, rows))."""
    rollouts = fixed_rollouts()
    monkeypatch.setattr(g, "generate", rollouts["fixed_generate"])
    calls, real = [], g.completion_logprobs

    def counting(model, input_ids, *args, **kwargs):
        calls.append((torch.is_grad_enabled(), len(input_ids)))
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(g, "completion_logprobs", counting)
    policy, tokenizer = sharp_tiny()
    models = g.Models(policy, tokenizer, torch.optim.SGD(policy.parameters(), lr=lr))
    settings = g.StepSettings.of(
        config("-K", "4", "--max-new-tokens", "5", "--beta", "0", *flags), autocast_dtype
    )
    rollout = g.sample_batch(models, [None, None], rollouts["PROMPTS"], settings, rollouts["toy_reward"])
    experience = g.make_experience(models, rollout, settings)
    return experience, g.update(models, experience, settings), calls


@pytest.mark.parametrize("micro", ["1", "2", "3"])
def test_pi_old_is_scored_on_the_micro_batches_the_loss_reads_and_is_exact_under_bf16(monkeypatch, micro):
    """bf16 autocast, each prompt shared by its K rows: the no-grad pass that fills pi_old must read
    the rows in the very micro-batches the first update's forward reads (a pass over the whole
    minibatch computes other bf16 roundings: a first ratio of 1.0005, and pi_old off by up to 0.04
    nats), so that the first update's ratio is exactly 1 and nothing is clipped."""
    experience, updates, calls = experience_and_updates(
        monkeypatch, "--sample-ratio", "1", "--micro-batch-size", micro, autocast_dtype=torch.bfloat16
    )
    old_pass = [rows for grad, rows in calls if not grad]
    loss_pass = [rows for grad, rows in calls if grad]
    assert old_pass == loss_pass == [len(part) for part in torch.arange(8).split(int(micro))]
    assert updates[0].ratio == 1.0 and updates[0].clip_fraction == 0.0


@pytest.mark.parametrize("loss_type", g.LOSS_TYPES)
def test_the_loss_weights_normalise_each_backprop_minibatch_not_the_sample_batch(monkeypatch, loss_type):
    """--sample-ratio 2, micro-batches of 1: each minibatch's weights make its own Eq. (9) (grpo and
    dapo sum to 1 over it, dr_grpo to its tokens / (G L)), whatever micro-batches compute it.
    Counting the whole sample batch's tokens for dapo would halve each minibatch's step; weights
    normalised per micro-batch would multiply it by the number of micro-batches."""
    experience, updates, _ = experience_and_updates(
        monkeypatch, "--sample-ratio", "2", "--micro-batch-size", "1", "--loss-type", loss_type
    )
    assert [len(rows) for rows in experience.minibatches] == [4, 4] and len(updates) == 2
    for rows in experience.minibatches:
        total = experience.loss_weights[rows].sum().item()
        tokens = experience.policy_mask[rows].sum().item()
        assert total == pytest.approx({"grpo": 1.0, "dapo": 1.0, "dr_grpo": tokens / (4 * 5)}[loss_type])


def test_pi_old_is_filled_once_so_a_second_pass_is_off_policy(monkeypatch):
    """--mu 2 over one minibatch with a real learning rate: the second pass compares pi_theta, moved
    by the first step, with pi_old from before the step. A pi_old scored again at each pass would
    give the second pass a ratio of exactly 1."""
    _, updates, calls = experience_and_updates(monkeypatch, "--sample-ratio", "1", "--mu", "2", lr=0.5)
    assert [u.ratio for u in updates][0] == 1.0 and abs(updates[1].ratio - 1.0) > 1e-4
    assert sum(not grad for grad, _ in calls) == 1  # one no-grad pass: pi_old (beta 0: no pi_ref)
