"""Stage 1 of SRT: supervised fine-tuning for capability warm-up (paper §3.3).

    phase 1  bootstrapping:      (P(Q_t, C~_t), Z_t, A*_t)   dependency-pruned histories C~_t
    phase 2  reasoning transfer: (P(Q_t, C_t),  Z_t, A*_t)   full histories, from phase 1's weights

Both phases minimise Eq. (3), the negative log-likelihood of the reasoning tokens r_1..r_M and the
answer tokens a_1..a_L given the prompt; prompt tokens carry no loss. AdamW with a constant learning
rate after a linear warm-up (§4.1). One optimizer and one step counter run across both phases.

Paper vs this implementation, the one list (docs/pipeline.md links here; the flags are in "beyond
the paper" and "the paper's §3.3 and §4.1 settings"):

  1. The phases' split: the paper gives none. --max-steps is split by --phase1-fraction (0.5; the
     cpu-table2 preset 0.4), or each phase runs --epochs epochs; --phase 1 or 2 runs one alone.
  2. The token budget (--max-length): a prompt too long loses its oldest utterances, whole and
     whatever they are, as at inference (srt/prompt.fit_history); a record whose H* would be cut is
     replaced by the next record that fits (PhaseData.example), so that an old turn's survival
     never tells the model it is gold. The prompt is fitted to what the full SRT target leaves.
  3. Eq. (3) is a sum; each step divides it by the target tokens of its whole global batch, so any
     split into micro-batches or ranks gives the same gradient. Batches are grouped by prompt
     length (PhaseData.epoch_batches) to pad little.
  4. --target: full (SRT's (Z_t, A*_t)), answer (Table 2's "w/o CoT", also --no-cot), recall-only
     (the <HIS> tags without prose; not in the paper). Batches depend on the prompts alone, so every
     target trains on exactly SRT's records in SRT's order.
  5. --recall copy (not in the paper; srt/recall.py): the turn's text inside each <HIS> tag and its
     </HIS>, which the decoder writes in copy mode, carry no loss; the tag's opening, its label and
     colon, the prose and the answer do.

    python stage1_sft.py --preset cpu-table2                        # SmolLM2-135M on a laptop CPU
    python stage1_sft.py --preset cpu-table2 --data syn/train.jsonl:0.5 locomo/train.jsonl:0.5   # a mix
    torchrun --nproc_per_node=8 stage1_sft.py --model Qwen/Qwen2.5-7B-Instruct --preset paper --fsdp
    python stage1_sft.py --model Qwen/Qwen2.5-7B-Instruct --preset paper --fsdp --dry-run --world-size 8

Outputs under --out: config.json, metrics.jsonl (one line per step), checkpoint/ (resumable),
final/ (save_pretrained), summary.json (steps, target, the answer tokens' share of the target
tokens), eval_format.json (with --eval-limit). Run `python stage1_sft.py --help`.
"""

from __future__ import annotations

import srt.startup  # noqa: F401  # isort: skip  (first: Ctrl-C while torch loads is one line)

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from srt.attention_kernel import bf16_eager_in_fp32, bf16_eager_note, register_bf16_eager
from srt.completion import is_valid_format
from srt.config import (
    MAX_EPOCHS,
    MAX_STEPS,
    add_batch_size,
    add_trust_remote_code,
    at_least,
    in_range,
    parse_config,
    require,
    up_to,
)
from srt.data_io import DataError, read_jsonl, read_mixture, write_json
from srt.distributed import accumulate, clip_grad_norm, full_weights
from srt.generation import generate
from srt.loading import end_of_turn_id
from srt.logprobs import target_logprobs
from srt.precision import peak_gpu_gb, resolve_dtype
from srt.probe import add_eval_flags
from srt.prompt import fit_history, format_target
from srt.recall import add_recall_flag, copied_spans
from srt.run import (
    Run,
    add_log_group,
    add_optimizer_flags,
    add_run_flags,
    add_scale_group,
    finish_parser,
    method_group,
    training_parser,
)
from srt.run import main as run_main
from srt.training import seed_everything, warmup_lr

# --------------------------------------------------------------------------------------------
# What Eq. (3) reads. A row is the prompt P(Q_t, C_t) (phase 2) or P(Q_t, C~_t) (phase 1), then the
# target (Z_t, A*_t) and an end-of-turn token (build_example, below): labels hold the target's token
# ids and IGNORE_INDEX on the prompt, answer_mask marks the answer a_1..a_L (the rest of the target
# is the reasoning r_1..r_M). A micro-batch is its rows right-padded.
# --------------------------------------------------------------------------------------------
IGNORE_INDEX = -100  # label of a token that carries no loss (the prompt, the padding)


def collate(examples, pad_id: int) -> dict:
    """Right-pad a micro-batch; padding is masked out of attention and loss."""
    width = max(len(e["input_ids"]) for e in examples)

    def pad(key, value):
        return torch.tensor([e[key] + [value] * (width - len(e[key])) for e in examples])

    input_ids = pad("input_ids", pad_id)
    return {
        "input_ids": input_ids,
        "labels": pad("labels", IGNORE_INDEX),
        "answer_mask": pad("answer_mask", 0),
        "attention_mask": pad("input_ids", -1).ne(-1).long(),
    }


# --------------------------------------------------------------------------------------------
# Eq. (3): L_SFT = - sum_i log pi(r_i | P, r_<i) - sum_j log pi(a_j | P, Z, a_<j)
# --------------------------------------------------------------------------------------------
def sft_loss_sums(model, batch, autocast_dtype=None) -> dict:
    """Eq. (3) summed over the micro-batch's target tokens, split into the reasoning part r_1..r_M
    and the answer part a_1..a_L, with the token counts. Callers divide by the target tokens of the
    whole global batch.

    -> a dict of six 0-d tensors: "nll", "reasoning_nll", "answer_nll" (sums of -log pi; "nll" is
    what the step backpropagates, so it carries the model's gradient) and "tokens",
    "reasoning_tokens", "answer_tokens" (their counts). A target token is one whose label is not
    IGNORE_INDEX (the prompt and the padding are not); an answer token is one of answer_mask, every
    other target token is reasoning."""
    logprobs, start = target_logprobs(
        model, batch["input_ids"], batch["attention_mask"], batch["labels"], autocast_dtype, IGNORE_INDEX
    )  # log pi(y_k | P, y_<k) for the target tokens y = (Z_t, A*_t); the prompt P has no label
    target = batch["labels"][:, start:].ne(IGNORE_INDEX)
    answer = batch["answer_mask"][:, start:].bool()
    nll = -logprobs * target
    reasoning = target & ~answer
    return {
        "nll": nll.sum(),
        "reasoning_nll": nll[reasoning].sum(),
        "answer_nll": nll[answer].sum(),
        "tokens": target.sum(),
        "reasoning_tokens": reasoning.sum(),
        "answer_tokens": answer.sum(),
    }


def per_token(totals: dict, nll_key: str, tokens_key: str) -> float | None:
    """The mean NLL a token of one kind (reasoning, answer, all) for the metrics line."""
    return totals[nll_key] / totals[tokens_key] if totals[tokens_key] else None


# --------------------------------------------------------------------------------------------
# Training examples: the prompt, fitted to --max-length, then the target in the --target format
# --------------------------------------------------------------------------------------------
ANSWER_MARKER = "Final answer:"


def visible_history(record, phase: int) -> list[dict]:
    """Phase 1 sees the dependency-pruned history C~_t, phase 2 the full history C_t."""
    if phase == 1:
        keep = set(record["pruned"])
        return [turn for turn in record["history"] if turn["label"] in keep]
    return list(record["history"])


def target_ids(tokenizer, target: str) -> tuple[list[int], int]:
    """Tokens of the target plus the end-of-turn token, and the index of the first answer token
    (the one that holds the first character of 'Final answer:')."""
    ids, answer_from, _ = target_tokens_and_offsets(tokenizer, target)
    return ids, answer_from


def target_tokens_and_offsets(tokenizer, target: str) -> tuple[list[int], int, list[tuple[int, int]]]:
    """target_ids, and each token's character span in `target` (the end-of-turn token's empty)."""
    encoded = tokenizer(target, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], [tuple(o) for o in encoded["offset_mapping"]]
    start = target.rfind(ANSWER_MARKER)
    answer_from = next(k for k, (_, end) in enumerate(offsets) if end > start)
    return ids + [end_of_turn_id(tokenizer)], answer_from, offsets + [(len(target), len(target))]


def copied_tokens(offsets, spans) -> list[bool]:
    """True for a target token that lies inside a span recall "copy"'s decoder writes (srt/recall.py
    copied_spans); a token that straddles a span's start holds the model's colon: it stays."""
    return [any(a <= start and end <= b and start < end for a, b in spans) for start, end in offsets]


# What each Table 2 variant learns to write: the SRT target (Z_t, A*_t), the answer alone ("w/o CoT"),
# or the <HIS> recalls alone before the answer (no Analyze or Reasoning prose).
TARGETS = {
    "full": {},
    "answer": {"with_reasoning": False},
    "recall-only": {"recall_only": True},
}


def build_example(
    tokenizer, record, phase: int, max_length: int, target: str = "full", recall: str = "free"
) -> dict | None:
    """input_ids = prompt + target + end-of-turn; labels = -100 on every prompt token (Eq. (3)
    conditions on the prompt but does not model it); answer_mask marks a_1..a_L, the rest of
    the target is r_1..r_M. Too long: drop the oldest turns, as at inference time. None when even
    that cannot fit, or when a turn of H* had to go: the target would cite a turn the prompt lost
    (such records are dropped rather than their gold turns protected, so survival is no tell).
    The prompt is fitted to what the full SRT target leaves, whatever `target` is, so SRT and its
    controls read the same prompts and drop the same records. recall "copy": the tokens of each tag
    that the decoder would write (the turn's text and `</HIS>`, srt/recall.py) carry no loss; the
    tag's opening, its label and colon, the prose and the answer do."""
    full_target, _ = target_ids(tokenizer, format_target(record))
    history = visible_history(record, phase)
    kept, prompt, prompt_ids = fit_history(tokenizer, record, history, max_length - len(full_target))
    if len(prompt_ids) + len(full_target) > max_length:
        return None
    if not set(record["recall"]) <= {turn["label"] for turn in kept}:
        return None
    target_text = format_target(record, **TARGETS[target])
    target_tokens, answer_from, offsets = target_tokens_and_offsets(tokenizer, target_text)
    copied = [False] * len(target_tokens)
    if recall == "copy":
        copied = copied_tokens(offsets, copied_spans(target_text, {t["label"]: t["text"] for t in kept}))
    target_labels = [IGNORE_INDEX if c else token for token, c in zip(target_tokens, copied)]
    labels = [IGNORE_INDEX] * len(prompt_ids) + target_labels
    answer_mask = [0] * (len(prompt_ids) + answer_from) + [1] * (len(target_tokens) - answer_from)
    return {
        "id": record["id"],
        "phase": phase,
        "prompt": prompt,
        "input_ids": prompt_ids + target_tokens,
        "labels": labels,
        "answer_mask": answer_mask,
        "dropped": len(history) - len(kept),
        "copied": sum(copied),
    }


# --------------------------------------------------------------------------------------------
# Batches: the same global batches on every rank and after a resume, each rank's share in
# micro-batches
# --------------------------------------------------------------------------------------------
class PhaseData:
    """The examples of one phase, tokenized lazily (a demo run sees a few hundred of the thousands
    of records), in a deterministic order that depends only on (seed, epoch): every rank computes the
    same global batches, and a resumed run the same ones as an uninterrupted run."""

    def __init__(
        self,
        tokenizer,
        records,
        phase,
        max_length,
        target,
        seed,
        global_batch,
        group_batches=32,
        recall="free",
    ):
        self.tokenizer, self.records, self.phase, self.recall = tokenizer, records, phase, recall
        self.max_length, self.target, self.seed = max_length, target, seed
        self.global_batch, self.group_batches = global_batch, group_batches
        self.cache, self.truncated, self.skipped, self.epochs = {}, set(), set(), {}
        # A cheap length proxy (characters) is enough to group examples of similar length. It is the
        # prompt's alone: every --target then forms the same batches, so Table 2's controls train on
        # exactly SRT's records, in SRT's order.
        self.approx_length = np.array(
            [sum(len(t["text"]) + 8 for t in visible_history(r, phase)) + len(r["query"]) for r in records]
        )
        self.batches_per_epoch = math.ceil(len(records) / global_batch)

    def example(self, index: int) -> dict:
        """Record `index`, or when it cannot fit in max_length, the next record that can."""
        for offset in range(len(self.records)):
            k = (index + offset) % len(self.records)
            if k not in self.cache:
                self.cache[k] = build_example(
                    self.tokenizer, self.records[k], self.phase, self.max_length, self.target, self.recall
                )
                if self.cache[k] is None:
                    self.skipped.add(k)
                elif self.cache[k]["dropped"]:
                    self.truncated.add(k)
            if self.cache[k] is not None:
                return self.cache[k]
        raise DataError(f"no record of phase {self.phase} fits in --max-length {self.max_length}")

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """Shuffle, wrap around to fill the last global batch, sort each group of `group_batches`
        global batches by length (little padding), then shuffle the batches."""
        if epoch not in self.epochs:
            rng = np.random.default_rng([self.seed, self.phase, epoch])
            order = np.resize(rng.permutation(len(self.records)), self.batches_per_epoch * self.global_batch)
            group = self.global_batch * self.group_batches
            batches = []
            for start in range(0, len(order), group):
                chunk = order[start : start + group]
                chunk = chunk[np.argsort(-self.approx_length[chunk], kind="stable")]
                batches += [chunk[k : k + self.global_batch] for k in range(0, len(chunk), self.global_batch)]
            self.epochs = {epoch: [batches[k] for k in rng.permutation(len(batches))]}
        return self.epochs[epoch]

    def batch_indices(self, phase_step: int) -> list[int]:
        """The record indices of the `phase_step`-th optimizer step of this phase (0-based)."""
        epoch, k = divmod(phase_step, self.batches_per_epoch)
        return [int(i) for i in self.epoch_batches(epoch)[k]]


def rank_micro_batches(phase_data, phase_step, rank, world_size, batch_size) -> list[list[dict]]:
    """This rank's examples of the step's global batch, in micro-batches: micro-batch `micro` of rank
    r holds slots (micro * world_size + r) * batch_size onwards."""
    indices = phase_data.batch_indices(phase_step)
    return [
        [phase_data.example(i) for i in indices[first : first + batch_size]]
        for first in range(rank * batch_size, len(indices), world_size * batch_size)
    ]


# --------------------------------------------------------------------------------------------
# One optimizer step of Eq. (3) over a global batch
# --------------------------------------------------------------------------------------------
@dataclass
class Learner:
    """What every step updates, and how: fixed once the run is prepared."""

    model: torch.nn.Module  # the parameters the optimizer steps and the clip measures
    train_model: torch.nn.Module  # what the loss calls: the model, or its DDP / FSDP wrapper
    optimizer: torch.optim.Optimizer
    pad_id: int
    device: torch.device
    world_size: int
    autocast_dtype: torch.dtype | None
    grad_accum: int  # micro-batches a step: DDP syncs the gradients on the last
    max_grad_norm: float


def sft_update(learner: Learner, micro_batches, lr: float):
    """One optimizer step of Eq. (3) over this rank's micro-batches. -> (the step's sums over every
    rank: nll, tokens, their reasoning and answer parts, all_tokens; the gradient norm)."""
    device, world_size = learner.device, learner.world_size
    # Eq. (3) sums over tokens; normalise by the target tokens of the whole global batch, so
    # every rank and micro-batch split gives the same gradient (DDP averages over ranks).
    targets = sum(len(e["labels"]) - e["labels"].count(IGNORE_INDEX) for part in micro_batches for e in part)
    global_tokens = torch.tensor(float(targets), device=device)
    if world_size > 1:
        dist.all_reduce(global_tokens)
    sums = {}
    for micro, examples in enumerate(micro_batches):
        batch = {k: v.to(device) for k, v in collate(examples, learner.pad_id).items()}
        with accumulate(learner.train_model, sync=micro == learner.grad_accum - 1 or world_size == 1):
            part = sft_loss_sums(learner.train_model, batch, learner.autocast_dtype)
            (part["nll"] * world_size / global_tokens).backward()
        for key, value in part.items():
            sums[key] = sums.get(key, 0) + value.detach().float()
        sums["all_tokens"] = sums.get("all_tokens", 0) + batch["attention_mask"].sum().float()
    grad_norm = clip_grad_norm(learner.model.parameters(), learner.max_grad_norm)
    for group in learner.optimizer.param_groups:
        group["lr"] = lr
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)

    keys = sorted(sums)
    totals = torch.stack([sums[k] for k in keys])
    if world_size > 1:
        dist.all_reduce(totals)
    return dict(zip(keys, totals.tolist())), grad_norm


def step_metrics(totals, lr, grad_norm, elapsed) -> dict:
    """The losses and rates of one step's line in metrics.jsonl, from sft_update's sums."""
    return {
        "loss": per_token(totals, "nll", "tokens"),
        "loss_reasoning": per_token(totals, "reasoning_nll", "reasoning_tokens"),
        "loss_answer": per_token(totals, "answer_nll", "answer_tokens"),
        # an answer token's weight in Eq. (3) is 1 / (target tokens): it differs by target
        "answer_token_share": totals["answer_tokens"] / max(totals["tokens"], 1.0),
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": totals["all_tokens"] / elapsed,
    }


# --------------------------------------------------------------------------------------------
# The training loop: phase 1 then phase 2, one optimizer and one step counter across both.
# --------------------------------------------------------------------------------------------
def phase_plan(cfg, records_per_phase: dict) -> list[tuple[int, int]]:
    """[(phase, steps), ...]. --max-steps is split between the phases by --phase1-fraction;
    without it each phase runs --epochs epochs."""
    phases = [1, 2] if cfg.phase == "both" else [int(cfg.phase)]
    global_batch = cfg.batch_size * cfg.grad_accum * cfg.world_size
    if cfg.max_steps is None:
        return [(p, cfg.epochs * math.ceil(records_per_phase[p] / global_batch)) for p in phases]
    if len(phases) == 1:
        return [(phases[0], cfg.max_steps)]
    first = round(cfg.max_steps * cfg.phase1_fraction)
    return [(1, first), (2, cfg.max_steps - first)]


def checked_plan(cfg, records: int) -> list[tuple[int, int]]:
    """phase_plan for `records` records a phase; more steps than a run may have end in one line."""
    plan = phase_plan(cfg, {1: records, 2: records})
    total_steps = sum(steps for _, steps in plan)
    global_batch = cfg.batch_size * cfg.grad_accum * cfg.world_size
    require(
        total_steps <= MAX_STEPS,
        f"--epochs {cfg.epochs} of {records:,} records in batches of {global_batch} make "
        f"{total_steps:,} steps, more than the {MAX_STEPS:,} a run may have; give fewer --epochs or "
        "--max-steps",
    )
    return plan


def train(cfg, parser=None):
    """Run stage 1 as configured by `cfg` (see parse_args). Returns the trained model."""
    run = Run(cfg, "stage1_sft.py", parser or build_parser())  # srt/run.py: --out, ranks, budget
    seed_everything(cfg.seed)
    records = read_mixture(cfg.data, cfg.seed, unique=True)  # one file: its records as they are
    run.record_data()
    if cfg.eval_limit > 0 and not Path(cfg.eval_data).is_file():  # read at the end: checked now
        raise DataError(f"--eval-data {cfg.eval_data}: no such file")
    model, tokenizer = run.load_model("sft")
    plan = checked_plan(cfg, len(records))
    total_steps = sum(steps for _, steps in plan)
    if run.finished(total_steps):
        return model
    model.train()
    model, train_model, optimizer = run.prepare(model, tokenizer)
    learner = Learner(
        model,
        train_model,
        optimizer,
        tokenizer.pad_token_id,
        run.device,
        run.world_size,
        run.autocast_dtype,
        cfg.grad_accum,
        cfg.max_grad_norm,
    )
    loaded_attention = model.config._attn_implementation
    use_training_attention(model, cfg, run)
    run.resume()
    global_batch = cfg.batch_size * cfg.grad_accum * run.world_size
    data = {
        p: PhaseData(
            tokenizer, records, p, cfg.max_length, cfg.target, cfg.seed, global_batch, recall=cfg.recall
        )
        for p, _ in plan
    }
    run.write_config(
        plan=plan,
        total_steps=total_steps,
        global_batch=global_batch,
        weight_dtype=str(resolve_dtype(cfg.dtype, run.device)[0]),
        autocast_dtype=str(run.autocast_dtype),
    )
    metrics = run.log("metrics.jsonl", every=cfg.log_every)
    step = train_steps(run, cfg, learner, data, plan, metrics)
    model.set_attn_implementation(loaded_attention)  # generation keeps the kernel it was loaded with

    run.save(step)
    run.save_final()
    report_end_of_run(run, cfg, data, metrics, step, total_steps)
    if cfg.eval_limit > 0:  # FSDP: every rank gathers the weights once, rank 0 generates alone
        with full_weights(model):
            if run.main_process:
                evaluate_format(model, tokenizer, cfg, run.device, run.autocast_dtype)
    return model


def use_training_attention(model, cfg, run) -> None:
    """--attention bf16_eager: the training steps' attention kernel keeps its scores in bf16."""
    if cfg.attention == "bf16_eager":  # faster on a bf16 CPU, other rounding: not the default
        model.set_attn_implementation(register_bf16_eager())
        if run.main_process and bf16_eager_in_fp32(
            resolve_dtype(cfg.dtype, run.device)[0], run.autocast_dtype
        ):
            print(bf16_eager_note(cfg.dtype), file=sys.stderr, flush=True)


def train_steps(run, cfg, learner: Learner, data: dict, plan, metrics) -> int:
    """The steps from the run's start (a resumed run's checkpoint) until the plan or the time budget
    ends, each logged, checkpointed and snapshotted as configured. -> the last step done."""
    phase_of_step = [(p, s) for p, steps in plan for s in range(steps)]  # step k+1 -> (phase, phase step)
    total_steps = len(phase_of_step)
    step = run.start_step
    bar = tqdm(total=total_steps, initial=step, disable=not run.main_process, desc="sft", dynamic_ncols=True)
    while run.keep_going(step, total_steps):
        tick = time.perf_counter()
        step += 1
        phase, phase_step = phase_of_step[step - 1]
        micro_batches = rank_micro_batches(data[phase], phase_step, run.rank, run.world_size, cfg.batch_size)
        lr = warmup_lr(step, cfg.lr, cfg.warmup_steps)
        totals, grad_norm = sft_update(learner, micro_batches, lr)
        elapsed = time.perf_counter() - tick
        run.budget.record_step(elapsed)
        if run.main_process:
            line = dict(step=step, phase=phase, **step_metrics(totals, lr, grad_norm, elapsed))
            line.update(
                truncated=len(data[phase].truncated),
                elapsed_s=round(run.budget.elapsed_s(), 1),
                step_s=elapsed,
                peak_gpu_gb=peak_gpu_gb(run.device),
            )
            if step % cfg.log_every == 0 or step == total_steps:
                metrics.append(line)
            bar.set_postfix(phase=phase, loss=f"{line['loss']:.3f}")
            bar.update(1)
        if step % cfg.save_every == 0 and step < total_steps:
            run.save(step)
        if cfg.snapshot_every and step % cfg.snapshot_every == 0 and step < total_steps:
            run.save_final(run.out / "snapshots" / f"step-{step}")
    bar.close()
    return step


def report_end_of_run(run, cfg, data, metrics, step, total_steps) -> None:
    """The warnings and the summary of a finished run: the examples cut to fit --max-length, a stop
    before the last step, and the answer tokens' share of the target (summary.json)."""
    if run.main_process:
        for p, phase_data in data.items():
            if phase_data.truncated or phase_data.skipped:
                print(
                    f"warning: phase {p}: {len(phase_data.truncated)} of {len(phase_data.cache)} examples "
                    f"lost old turns to fit --max-length {cfg.max_length}; "
                    f"{len(phase_data.skipped)} could not fit without losing a turn of H* and were replaced",
                    flush=True,
                )
    run.warn_if_stopped_early(step, total_steps)
    if run.main_process:
        print(f"saved {run.out / 'final'} (step {step})", flush=True)
        shares = [row["answer_token_share"] for row in metrics.rows if "answer_token_share" in row]
        summary = {
            "steps": step,
            "target": cfg.target,
            "answer_token_share": float(np.mean(shares)) if shares else None,
        }
        run.write_summary(summary)  # Table 2's controls differ in what an answer token weighs
        if shares:
            share = summary["answer_token_share"]
            print(f"answer tokens: {share:.1%} of the target tokens (--target {cfg.target})", flush=True)
    run.barrier()


# --------------------------------------------------------------------------------------------
# Configuration: argparse defaults that work (the paper's values where it gives one), presets (each
# a dict of flag values, saying why it differs), explicit flags win.
# --------------------------------------------------------------------------------------------
# Why each value: docs/experiments/presets.md ("Stage 1").
# fmt: off
PRESETS = {
    # `make table2` on a 2-core laptop: 64 steps (26 on pruned histories, 38 on full ones), the fewest
    # that teach recall; 1536 tokens hold all but 5 of 2,341 synthetic prompts + targets; the global batch
    # of 4 runs as 2 micro-batches of 2, which keeps the peak memory low at the same update.
    "cpu-table2": dict(lr=5e-5, batch_size=2, grad_accum=2, max_length=1536, gradient_checkpointing=False,
                       max_steps=64, phase1_fraction=0.4, warmup_steps=3, save_every=8),
    # §4.1: lr 5e-6, AdamW, constant schedule with linear warm-up. Batch and length are ours.
    "paper": dict(lr=5e-6, batch_size=2, grad_accum=8, max_length=4096, gradient_checkpointing=True,
                  warmup_steps=30, epochs=2, save_every=200),
}
# The SFT start GRPO learns from (docs/experiments/grpo-recall.md): twice cpu-table2's steps.
PRESETS["cpu-long"] = dict(PRESETS["cpu-table2"], max_steps=128)
# `make demo`, the lesson: dialogues of 8-11 rounds (stage 0's cpu-lesson), so 1024 tokens hold every
# prompt + target; recall is learned from the full-history records, so phase 1 (10 steps) only teaches
# the format, and the learning rate is 4x cpu-table2's. 90 full-history steps, because fewer missed
# the lesson's recall bar on one of the CPUs it was run on; a checkpoint (weights and AdamW's
# moments) takes seconds to write, so one every 20 steps, not 8 (docs/experiments/presets.md, "The
# lesson": each lever and what it cost; demo.md).
PRESETS["cpu-lesson"] = dict(PRESETS["cpu-table2"], lr=2e-4, max_length=1024, max_steps=100,
                             phase1_fraction=0.1, save_every=20)
# fmt: on


def build_parser() -> argparse.ArgumentParser:
    p = training_parser(__doc__.split("\n\n")[0])
    run = add_run_flags(p, "sft")  # srt/run.py: --model, --data, --out, --resume, --max-steps, ...
    add_trust_remote_code(run, "allow model code from the hub")

    paper = method_group(
        p,
        "the paper's §3.3 and §4.1 settings",
        "§4.1 gives the learning rate, AdamW and the linear warm-up; the phase split, the batch and the "
        "length are ours",
    )
    add = paper.add_argument
    add(
        "--phase",
        choices=["1", "2", "both"],
        default="both",
        help="1: pruned histories C~_t, 2: full histories C_t, both: 1 then 2",
    )
    add("--phase1-fraction", type=in_range(0.0, 1.0), default=0.5, help="share of --max-steps for phase 1")
    add("--epochs", type=up_to(MAX_EPOCHS), default=1, help="epochs per phase when --max-steps is unset")
    add_optimizer_flags(
        paper,
        lr=5e-6,
        lr_help="peak learning rate (§4.1: 5e-6)",
        warmup_steps=10,
        warmup_help="linear warm-up steps",
    )
    add(
        "--max-length",
        type=at_least(1),
        default=1024,
        help="tokens per example; longer histories lose their oldest turns (a record whose H* "
        "would be cut is replaced by the next one)",
    )
    add_batch_size(paper, 4, "examples per micro-batch per process")
    add("--grad-accum", type=at_least(1), default=1, help="micro-batches per optimizer step")

    beyond = method_group(
        p, "beyond the paper", "the paper's choice by default; the module docstring lists them"
    )
    add = beyond.add_argument
    add(
        "--target",
        choices=sorted(TARGETS),
        default="full",
        help="what the model learns to write: full (SRT), answer (Table 2 'w/o CoT'), recall-only "
        "(the <HIS> tags without prose); every target trains on the same batches",
    )
    add(
        "--no-cot",
        dest="target",
        action="store_const",
        const="answer",
        default=argparse.SUPPRESS,
        help="the same as --target answer (Table 2 'w/o CoT')",
    )
    add_recall_flag(
        beyond,
        "copy: the turn's text inside each <HIS> tag (and its </HIS>), which the decoder writes in "
        "copy mode (srt/recall.py), carries no loss; free: every target token does (the paper)",
    )

    scale = add_scale_group(p)
    scale.add_argument(
        "--attention",
        choices=["sdpa", "bf16_eager"],
        default="sdpa",
        help="the attention kernel of the training steps: bf16_eager "
        "(attention_kernel.bf16_eager_attention) keeps the scores in bf16: a lesson step in 0.84x the time "
        "on a bf16 CPU, with other rounding (bench/README.md, sft_step.py; docs/experiments/demo.md)",
    )
    logs = add_log_group(p, save_every_default=50, save_every_low=1)
    add = logs.add_argument
    add(
        "--snapshot-every",
        type=at_least(0),
        default=0,
        help="also keep the model of every N-th step as <out>/snapshots/step-N (save_pretrained), for a "
        "learning curve; 0: none",
    )
    add("--log-every", type=at_least(1), default=1, help="append to metrics.jsonl every N steps")
    add_eval_flags(
        logs,
        data="runs/data/dev.jsonl",
        data_help="held-out JSONL for the final check",
        limit=0,
        limit_help="generate on N held-out records at the end and report format validity",
        max_new_tokens=256,
    )
    return finish_parser(p, scale)


def parse_args(argv=None) -> argparse.Namespace:
    return parse_config(build_parser(), PRESETS, argv)


# --------------------------------------------------------------------------------------------
# Optional final check: does the model now write the SRT format on held-out queries?
# --------------------------------------------------------------------------------------------
def evaluate_format(model, tokenizer, cfg, device, autocast_dtype, batch_size=4) -> dict:

    records = read_jsonl(cfg.eval_data)[: cfg.eval_limit]
    budget = cfg.max_length - cfg.eval_max_new_tokens
    completions = []
    for start in range(0, len(records), batch_size):
        # At test time H* is unknown: drop the oldest turns, whatever they are.
        prompts = [
            fit_history(tokenizer, r, r["history"], budget)[1] for r in records[start : start + batch_size]
        ]
        completions += generate(
            model, tokenizer, prompts, cfg.eval_max_new_tokens, greedy=True, autocast_dtype=autocast_dtype
        )["texts"]
    valid = [bool(is_valid_format(c)) for c in completions]
    result = {
        "format_valid": sum(valid) / max(len(valid), 1),
        "n": len(valid),
        "samples": [
            {"id": r["id"], "completion": c, "valid": v} for r, c, v in zip(records, completions, valid)
        ],
    }
    write_json(Path(cfg.out) / "eval_format.json", result)
    print(f"format validity on {len(valid)} held-out records: {result['format_valid']:.1%}", flush=True)
    return result


def main(argv=None) -> None:
    run_main(parse_args(argv), "sft", train)


if __name__ == "__main__":
    main()
