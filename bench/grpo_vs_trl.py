"""Benchmark: our from-scratch GRPO (stage2_grpo.py) against TRL's GRPOTrainer, side by side.

Both sides train the same model on the same prompts, in the same order, with the same reward
(reward.compute_rewards), the same group size K, sampling settings, learning rate, KL weight and
the same number of completions per optimizer update and of forward / backward passes. Each side
runs in its own subprocess, so that its peak memory is its own:

    ours  python bench/grpo_vs_trl.py --worker ours  -> stage2_grpo.main(["--max-steps", N, ...])
    trl   .venv-trl/bin/python bench/grpo_vs_trl.py --worker trl -> GRPOTrainer(...).train()

Set-up (TRL lives in its own venv so that it can never move the main environment's packages) and
the command: see bench/README.md. Run `python bench/grpo_vs_trl.py --help`.

What is measured
----------------
One *GRPO step* is what stage2_grpo calls a step: sample P x K completions (P prompts, K each),
score them, then mu passes over S backprop minibatches of P*K/S completions, one AdamW update per
minibatch, so S * mu updates a step. TRL counts optimizer updates as steps, so one of our steps is
S * mu consecutive TRL steps (the first of which generates). The table compares, per GRPO step:
wall seconds (mean over steps 2..N: step 1 is a warm-up and is left out), the part spent sampling
and the part spent scoring, seconds per optimizer update (= step / (S * mu)), the mean completion
length (sampling is random, so it differs between the sides, and time grows with it), the peak
resident set size of the process (resource.getrusage ru_maxrss) and on a GPU the peak of
torch.cuda.max_memory_allocated, both read at the end of the last step (model loading included,
our final checkpoint save excluded).

Where the times come from. Ours: step_s, generate_s and score_s of <out>/ours/metrics.jsonl, the
log stage2_grpo writes anyway (stage2_grpo.py is not modified; the worker only wraps
stage2_grpo.grpo_step from outside to note the memory high-water mark and the prompts each step
saw). TRL: a TrainerCallback timing on_step_begin -> on_step_end (generation happens inside,
in training_step), a subclass that times GRPOTrainer._generate, and the reward wrapper's own clock.

Knob mapping (ours -> TRL GRPOConfig)
-------------------------------------
    -K / --num-generations K       num_generations = K
    --prompts-per-step P           generation_batch_size = P * K (via steps_per_generation below)
    --sample-ratio S               per_device_train_batch_size = P * K / S (S capped at P * K, as ours does),
                                   gradient_accumulation_steps = 1, steps_per_generation = S
                                   (so each AdamW update sees P*K/S completions on both sides)
    --mu                           num_iterations = mu
    --max-steps N (GRPO steps)     max_steps = N * S * mu (optimizer updates)
    --max-new-tokens               max_completion_length
    --temperature, --top-p         temperature, top_p; top_k = 0 on both (no hidden top-k cut)
    --lr, --warmup-steps 0         learning_rate, lr_scheduler_type = "constant", warmup_steps = 0
    --weight-decay 0, --max-grad-norm 1.0, AdamW   weight_decay, max_grad_norm, optim = "adamw_torch"
    --beta, --clip-eps             beta (> 0 loads the frozen reference model on both sides), epsilon
    --loss-norm seq | token        loss_type = "grpo" (per-completion mean, Eq. (9)) | "bnpo"
    Eq. (8) group std              scale_rewards = "group"
    --dtype auto                   fp32 weights; bf16 = True (autocast) exactly where ours autocasts
                                   (modeling.resolve_dtype: any GPU, an AMX CPU); use_cpu = no GPU
    --gradient-checkpointing       gradient_checkpointing (TRL defaults to True; here both follow the flag)
    --seed                         seed; shuffle_dataset = False (see "prompts")
    no eval, no samples, no saving eval_strategy = "no", save_strategy = "no", report_to = "none",
                                   log_completions = False

Prompts. The bench draws the N * P training prompts exactly as stage2_grpo will (its PromptStream:
the same data file, seed and --max-prompt-length, including its re-rendering of over-long
histories), renders them once with stage0_build.render_prompt, and hands TRL the rendered strings
as plain-text prompts, in that order, with shuffle_dataset = False, so TRL applies no chat template
of its own. Both workers record the prompts they actually saw, and the report says whether they
were identical. TRL tokenizes a plain prompt with the tokenizer's default add_special_tokens
(ours passes False); the TRL worker checks that this gives the same ids (it does for SmolLM2 and
the tiny model, which add no BOS) and the report says so if not.

Mismatches that remain (TRL's design, not removable through its config):
  - Reward normalization: ours divides by the population std + 1e-8 (and zeroes a group of equal
    rewards), TRL by the sample std + 1e-4. Same cost; advantages differ by a constant factor.
  - TRL shuffles the rows of a generation batch before splitting it into minibatches; ours splits
    in order. The same rows are padded to the same width either way.
  - Log-probs: TRL asks transformers for fused log-probs (fused_lm_head, labels), ours takes a
    log_softmax over the vocabulary of the completion positions (logits_to_keep): a real
    implementation difference that the benchmark is there to measure.
  - Sampling draws different random numbers on the two sides, so completion lengths differ; the
    table shows the mean length beside the times.
  - One process only (no torchrun / accelerate launch).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/grpo_vs_trl.py`: the stage files live one level up
    sys.path.insert(0, str(ROOT))

from data_io import atomic_write_text, read_jsonl, write_json  # noqa: E402

DEFAULT_TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
WARMUP_STEPS = 1  # GRPO steps left out of the means (the first one pays for lazy initialisation)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from stage2_grpo import build_parser as stage2_parser
    D = vars(stage2_parser().parse_args([]))  # the benchmark's defaults are stage 2's own
    p = argparse.ArgumentParser(
        description="GRPO step time and peak memory: stage2_grpo.py vs TRL's GRPOTrainer, side by side.",
        epilog="Set-up and examples: bench/README.md. The knob mapping is in this script's docstring.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--model", default="smollm2-135m", help="a local folder, a Hugging Face id, smollm2-135m or tiny-random")
    add("--data", default="runs/data/train.jsonl", help="stage-0 training records (JSONL)")
    add("--synthetic", type=int, metavar="N",
        help="instead of --data, build N synthetic dialogues with stage0_build in a temporary folder")
    add("--out", default="runs/bench/grpo_vs_trl", help="writes results.json and results.md here")
    add("--steps", type=int, default=4, help="GRPO steps per side (the first is a warm-up, left out of the means)")
    add("-K", "--num-generations", type=int, default=D["num_generations"], help="completions per prompt")
    add("--prompts-per-step", type=int, default=D["prompts_per_step"], help="prompts per GRPO step (P)")
    add("--sample-ratio", type=int, default=D["sample_ratio"],
        help="S: a GRPO step's P*K completions make S backprop minibatches, one AdamW update each")
    add("--mu", type=int, default=D["mu"], help="passes over each sample batch (TRL num_iterations)")
    add("--max-new-tokens", type=int, default=D["max_new_tokens"], help="completion length cap")
    add("--max-prompt-length", type=int, default=D["max_prompt_length"],
        help="prompt token cap, applied the way stage2_grpo applies it (0 = none)")
    add("--temperature", type=float, default=D["temperature"], help="sampling temperature")
    add("--top-p", type=float, default=D["top_p"], help="nucleus sampling; no top-k cut on either side")
    add("--lr", type=float, default=D["lr"], help="constant learning rate (no warm-up on either side)")
    add("--beta", type=float, default=D["beta"], help="KL weight; > 0 loads the reference model on both sides")
    add("--clip-eps", type=float, default=D["clip_eps"], help="epsilon of the clipped ratio (TRL epsilon)")
    add("--loss-norm", choices=["seq", "token"], default=D["loss_norm"], help="TRL loss_type grpo | bnpo")
    add("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
        help="auto: fp32 weights, bf16 autocast on a GPU or an AMX CPU (modeling.resolve_dtype)")
    add("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False,
        help="on both sides (TRL's own default is on, ours off)")
    add("--seed", type=int, default=0, help="data order and sampling seed, both sides")
    add("--trl-python", default=str(DEFAULT_TRL_PYTHON), help="a python that can import trl")
    add("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)  # internal: run one side
    add("--spec", help=argparse.SUPPRESS)
    return p


def trl_install_hint() -> str:
    version = metadata.version("transformers")
    return (f"python -m venv --system-site-packages .venv-trl && "
            f".venv-trl/bin/pip install trl 'transformers=={version}'")


# --------------------------------------------------------------------------------------------
# Shared helpers (parent and workers)
# --------------------------------------------------------------------------------------------
def digest(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def memory_mark() -> dict:
    import torch
    mark = {"peak_rss_gib": peak_rss_gib()}
    if torch.cuda.is_available():
        mark["peak_cuda_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        mark["peak_cuda_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return mark


def versions() -> dict:
    found = {}
    for name in ("torch", "transformers", "accelerate", "trl"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def make_trl_reward(reward_fn=None, log=None):
    """reward.compute_rewards as a TRL reward function. TRL calls it with the prompts, the decoded
    completions and every other dataset column as a list; the bench's dataset carries each stage-0
    record as a JSON string in the column `record`. The K rollouts of one prompt share one decoded
    record (compute_rewards then indexes its history once, as it does for ours). Returns the total
    reward R = format + recall + answer (Eq. (4)) per completion. When `log` is a list, one entry per
    call is appended: seconds, the distinct prompts (digests, in order) and the mean length."""
    def srt_reward(prompts, completions, record, completion_ids=None, **kwargs):
        from reward import compute_rewards
        start = time.perf_counter()
        decoded = {}
        examples = []
        for text in record:
            if text not in decoded:
                decoded[text] = json.loads(text)
            examples.append(decoded[text])
        scores = (reward_fn or compute_rewards)(list(completions), examples)
        totals = [float(s["total"]) for s in scores]
        if log is not None:
            lengths = [len(ids) for ids in completion_ids] if completion_ids is not None else []
            log.append({"seconds": time.perf_counter() - start,
                        "prompts": list(dict.fromkeys(digest(p) for p in prompts)),
                        "completion_length": sum(lengths) / len(lengths) if lengths else None})
        return [t if math.isfinite(t) else None for t in totals]  # TRL turns None into NaN
    return srt_reward


# --------------------------------------------------------------------------------------------
# The summary and the ratio table (pure functions: tests/test_bench.py checks them by hand)
# --------------------------------------------------------------------------------------------
def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(side: dict, warmup: int = WARMUP_STEPS) -> dict:
    """Means over the GRPO steps after the first `warmup` ones, and the memory peaks."""
    steps = side["steps"][warmup:]
    summary = {"measured_steps": len(steps)}
    for key in ("seconds", "generate_s", "score_s", "completion_length"):
        summary[key] = _mean([s.get(key) for s in steps])
    if summary["seconds"] is not None and summary["generate_s"] is not None and summary["score_s"] is not None:
        summary["train_s"] = summary["seconds"] - summary["generate_s"] - summary["score_s"]
    else:
        summary["train_s"] = None
    updates = side.get("updates_per_step")
    summary["seconds_per_update"] = summary["seconds"] / updates if summary["seconds"] is not None and updates else None
    for key in ("peak_rss_gib", "peak_cuda_allocated_gib"):
        summary[key] = side.get(key)
    return summary


TABLE_ROWS = [  # (key, label)
    ("seconds", "GRPO step, s (mean, warm-up left out)"),
    ("generate_s", "  of which sampling, s"),
    ("score_s", "  of which reward, s"),
    ("train_s", "  of which log-probs + updates, s"),
    ("seconds_per_update", "per optimizer update, s"),
    ("completion_length", "completion length, tokens (mean)"),
    ("peak_rss_gib", "peak RSS, GiB"),
    ("peak_cuda_allocated_gib", "peak CUDA allocated, GiB"),
]


def ratio_rows(ours: dict, trl: dict) -> list[dict]:
    """One row per metric that at least one side has: ours, TRL and ours / TRL (None where
    undefined). Below 1 means ours is faster or smaller."""
    rows = []
    for key, label in TABLE_ROWS:
        a, b = ours.get(key), trl.get(key)
        if a is None and b is None:
            continue
        ratio = a / b if a is not None and b not in (None, 0) else None
        rows.append({"metric": key, "label": label, "ours": a, "trl": b, "ratio": ratio})
    return rows


def _fmt(value, digits=3) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| metric | ours | TRL | ours / TRL |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['label']} | {_fmt(r['ours'])} | {_fmt(r['trl'])} | "
                     f"{'n/a' if r['ratio'] is None else format(r['ratio'], '.2f')} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Parent: model, data and prompts, then one subprocess per side
# --------------------------------------------------------------------------------------------
def resolve_model_dir(name: str, out: Path) -> str:
    """A folder both sides load from (TRL builds its reference model from the policy's folder).
    tiny-random is saved once under <out>; smollm2-135m is stage 1's cached conversion."""
    from modeling import cache_dir, load_model_and_tokenizer
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
    from data_io import DataError
    from modeling import load_model_and_tokenizer
    from stage0_build import PromptStream
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
        sys.exit(f"error: {python} not found; set up TRL's venv with: {hint}")
    probe = subprocess.run([python, "-c", "import trl"], capture_output=True, text=True, cwd=ROOT)
    if probe.returncode != 0:
        sys.exit(f"error: {python} cannot import trl; set it up with: {hint}")


def run_side(python: str, side: str, spec_path: Path) -> dict:
    result = spec_path.parent / f"side_{side}.json"
    result.unlink(missing_ok=True)  # never read a previous run's report
    print(f"\n=== {side}: {python} {Path(__file__).name} --worker {side}", flush=True)
    done = subprocess.run([python, str(Path(__file__).resolve()), "--worker", side, "--spec", str(spec_path)],
                          cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"error: the {side} side failed (exit {done.returncode}); its output is above")
    return json.loads(result.read_text())


def compare(ours: dict, trl: dict, spec: dict) -> list[str]:
    """Conditions of a fair comparison that this run could check, as plain sentences."""
    notes = []
    expected = spec["expected_prompts"]
    for side, name in ((ours, "ours"), (trl, "TRL")):
        seen = [s.get("prompts") for s in side["steps"]]
        updates = sorted({s.get("updates") for s in side["steps"]}, key=str)
        notes.append(f"{name}: trained on the expected prompts in the expected order: {seen == expected}; "
                     f"optimizer updates per GRPO step: {', '.join(map(str, updates))} "
                     f"(expected {spec['updates_per_step']})")
    if trl.get("prompt_tokens_identical") is False:
        notes.append("TRL's tokenization of the prompts differs from ours (it adds special tokens)")
    for package in ("torch", "transformers"):
        if ours["versions"].get(package) != trl["versions"].get(package):
            notes.append(f"{package} differs: ours {ours['versions'].get(package)}, "
                         f"TRL venv {trl['versions'].get(package)}")
    if ours.get("autocast") != trl.get("autocast") or ours.get("device") != trl.get("device"):
        notes.append(f"precision / device differ: ours {ours.get('device')} {ours.get('autocast')}, "
                     f"TRL {trl.get('device')} {trl.get('autocast')}")
    return notes


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        return run_ours(spec) if args.worker == "ours" else run_trl(spec)

    K, P = args.num_generations, args.prompts_per_step
    S = min(args.sample_ratio, P * K)  # stage2_grpo makes at most one minibatch per completion
    if args.steps < 2:
        sys.exit("error: --steps must be at least 2 (step 1 is a warm-up and is left out of the means)")
    if K < 2:
        sys.exit("error: -K must be at least 2 (TRL refuses smaller groups)")
    if (P * K) % S:
        sys.exit(f"error: P * K = {P * K} completions do not split into {S} equal minibatches (--sample-ratio) "
                 f"(TRL needs per_device_train_batch_size = P * K / S to be a whole number)")
    if not args.synthetic and not Path(args.data).exists():
        sys.exit(f"error: {args.data} not found; build it with `python stage0_build.py --source synthetic "
                 f"--out {Path(args.data).parent}`, or pass --synthetic N")
    check_trl(args.trl_python)  # fail before spending minutes on our side

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl-") as tmp:
        data = args.data
        if args.synthetic:
            import stage0_build
            data_dir = Path(tmp) / "data"
            stage0_build.main(["--source", "synthetic", "--num-dialogues", str(args.synthetic),
                               "--out", str(data_dir), "--seed", str(args.seed), "--quiet",
                               "--dev-fraction", "0", "--test-fraction", "0"])
            data = str(data_dir / "train.jsonl")

        model_dir = resolve_model_dir(args.model, out)
        pairs = pick_prompts(data, model_dir, args)
        trl_rows = out / "trl_prompts.jsonl"
        atomic_write_text(trl_rows, "".join(json.dumps({"prompt": prompt, "record": json.dumps(record)}) + "\n"
                                            for record, prompt in pairs))
        config = {k: v for k, v in vars(args).items() if k not in ("worker", "spec", "trl_python")}
        spec = dict(config, model_dir=model_dir, data=data, out=str(out), trl_prompts=str(trl_rows),
                    minibatches=S, updates_per_step=S * args.mu,
                    expected_prompts=[[digest(p) for _, p in pairs[i * P:(i + 1) * P]] for i in range(args.steps)])
        spec_path = out / "spec.json"
        write_json(spec_path, spec)

        ours = run_side(sys.executable, "ours", spec_path)
        trl = run_side(args.trl_python, "trl", spec_path)

    summary = {"ours": summarize(ours), "trl": summarize(trl)}
    rows = ratio_rows(summary["ours"], summary["trl"])
    notes = compare(ours, trl, spec)
    table = markdown_table(rows)
    command = "python bench/grpo_vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:])
    setting = (f"model `{args.model}`, {args.steps} GRPO steps per side ({args.steps - WARMUP_STEPS} measured), "
               f"P = {P} prompt(s) x K = {K} completions of up to {args.max_new_tokens} new tokens a step, "
               f"S = {S} minibatches x mu = {args.mu} pass(es) = {S * args.mu} AdamW updates a step, "
               f"beta = {args.beta}, lr = {args.lr}, device {ours.get('device')}, "
               f"autocast {ours.get('autocast') or 'none'}, gradient checkpointing {args.gradient_checkpointing}")
    text = "\n".join([
        "# GRPO: stage2_grpo.py vs TRL GRPOTrainer", "", f"`{command}`", "", setting + ".", "",
        table, "", "Ratios below 1: ours is faster or smaller.", "", "Checks:", "", *[f"- {n}" for n in notes], "",
        f"Versions: ours {ours['versions']}; TRL side {trl['versions']}.", "",
        "Knob mapping and the mismatches that remain: the docstring of bench/grpo_vs_trl.py.", ""])
    write_json(out / "results.json", {"command": command, "config": config, "summary": summary, "ratios": rows,
                                      "checks": notes, "ours": ours, "trl": trl})
    atomic_write_text(out / "results.md", text)
    print("\n" + setting + "\n\n" + table + "\n\n" + "\n".join(notes) + f"\n\nwritten: {out / 'results.md'}, "
          f"{out / 'results.json'}", flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# Worker: ours (stage2_grpo.main, its metrics.jsonl, a wrapper around grpo_step for memory marks)
# --------------------------------------------------------------------------------------------
def run_ours(spec: dict) -> int:
    import stage2_grpo
    from modeling import resolve_dtype
    import torch

    run_dir = Path(spec["out"]) / "ours"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = ["--model", spec["model_dir"], "--data", spec["data"], "--out", str(run_dir), "--seed", str(spec["seed"]),
            "--max-steps", str(spec["steps"]), "-K", str(spec["num_generations"]),
            "--prompts-per-step", str(spec["prompts_per_step"]), "--sample-ratio", str(spec["sample_ratio"]),
            "--mu", str(spec["mu"]), "--max-new-tokens", str(spec["max_new_tokens"]),
            "--max-prompt-length", str(spec["max_prompt_length"]), "--temperature", str(spec["temperature"]),
            "--top-p", str(spec["top_p"]), "--lr", str(spec["lr"]), "--warmup-steps", "0",
            "--weight-decay", "0", "--max-grad-norm", "1.0", "--beta", str(spec["beta"]),
            "--clip-eps", str(spec["clip_eps"]), "--loss-norm", spec["loss_norm"], "--dtype", spec["dtype"],
            "--gradient-checkpointing" if spec["gradient_checkpointing"] else "--no-gradient-checkpointing",
            "--eval-limit", "0", "--sample-every", "0", "--save-every", "0"]

    marks = []
    grpo_step = stage2_grpo.grpo_step

    def marked_grpo_step(policy, ref_model, tokenizer, optimizer, records, prompts, cfg, **kwargs):
        result = grpo_step(policy, ref_model, tokenizer, optimizer, records, prompts, cfg, **kwargs)
        marks.append({"prompts": [digest(p) for p in prompts], **memory_mark()})
        return result

    stage2_grpo.grpo_step = marked_grpo_step  # train() looks the name up at call time
    start = time.perf_counter()
    stage2_grpo.train(stage2_grpo.parse_args(argv))
    total = time.perf_counter() - start

    metrics = read_jsonl(run_dir / "metrics.jsonl", validate=False)
    steps = [{"step": m["step"], "seconds": m["step_s"], "generate_s": m["generate_s"], "score_s": m["score_s"],
              "completion_length": m["completion_length"], "updates": m["updates"], **mark}
             for m, mark in zip(metrics, marks)]
    for bulky in ("checkpoint", "final"):  # two copies of the weights the benchmark does not need
        shutil.rmtree(run_dir / bulky, ignore_errors=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, autocast_dtype = resolve_dtype(spec["dtype"], device)
    side = {"side": "ours", "steps": steps, "updates_per_step": spec["updates_per_step"], "device": device,
            "autocast": str(autocast_dtype).replace("torch.", "") if autocast_dtype else None,
            **{k: marks[-1].get(k) for k in ("peak_rss_gib", "peak_cuda_allocated_gib", "peak_cuda_reserved_gib")},
            "peak_rss_gib_process": peak_rss_gib(), "total_s": total, "argv": argv, "versions": versions()}
    write_json(Path(spec["out"]) / "side_ours.json", side)
    return 0


# --------------------------------------------------------------------------------------------
# Worker: TRL (GRPOTrainer with the mapped config, a step clock, a timed _generate)
# --------------------------------------------------------------------------------------------
def run_trl(spec: dict) -> int:
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        sys.exit(f"error: {e}; set up TRL's venv with: {trl_install_hint()}")
    import torch
    from modeling import load_model_and_tokenizer, resolve_dtype

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    weight_dtype, autocast_dtype = resolve_dtype(spec["dtype"], device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # The same loader as ours: pad token, ChatML fallback, <|im_end|> among the stop tokens.
    model, tokenizer = load_model_and_tokenizer(spec["model_dir"], dtype=spec["dtype"])
    rows = read_jsonl(spec["trl_prompts"], validate=False)
    prompt_tokens_identical = all(
        tokenizer(text=r["prompt"])["input_ids"] == tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        for r in rows)

    K, P, S, mu = spec["num_generations"], spec["prompts_per_step"], spec["minibatches"], spec["mu"]
    run_dir = Path(spec["out"]) / "trl"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = GRPOConfig(
        output_dir=str(run_dir), seed=spec["seed"], data_seed=spec["seed"],
        num_generations=K, per_device_train_batch_size=P * K // S, gradient_accumulation_steps=1,
        steps_per_generation=S, num_iterations=mu, max_steps=spec["steps"] * S * mu,
        max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"], top_p=spec["top_p"],
        top_k=0, learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch", beta=spec["beta"], epsilon=spec["clip_eps"],
        loss_type={"seq": "grpo", "token": "bnpo"}[spec["loss_norm"]], scale_rewards="group",
        shuffle_dataset=False, gradient_checkpointing=spec["gradient_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=autocast_dtype == torch.bfloat16, fp16=False, use_cpu=not cuda,
        report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no", log_completions=False,
        dataloader_num_workers=0, remove_unused_columns=False)

    class StepClock(TrainerCallback):
        """Wall time of every optimizer update (generation included when it happens in one)."""
        def __init__(self):
            self.seconds, self.marks = [], []

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.seconds.append(time.perf_counter() - self.start)
            self.marks.append(memory_mark())

    generated = []  # seconds spent sampling each generation batch

    class TimedGRPOTrainer(GRPOTrainer):
        """Times GRPOTrainer._generate (tokenize, generate, decode; private API, so optional)."""
        def _generate(self, prompts):
            sync()
            start = time.perf_counter()
            result = super()._generate(prompts)
            sync()
            generated.append(time.perf_counter() - start)
            return result

    trainer_class = TimedGRPOTrainer if hasattr(GRPOTrainer, "_generate") else GRPOTrainer
    reward_log, clock = [], StepClock()
    trainer = trainer_class(model=model, reward_funcs=make_trl_reward(log=reward_log), args=config,
                            train_dataset=Dataset.from_list(rows), processing_class=tokenizer, callbacks=[clock])
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    if run_dir.exists() and not any(run_dir.iterdir()):  # save_strategy "no": nothing was written
        run_dir.rmdir()

    n = S * mu  # optimizer updates per GRPO step
    steps = []
    for i in range(len(clock.seconds) // n):
        steps.append({"step": i + 1, "seconds": sum(clock.seconds[i * n:(i + 1) * n]),
                      "generate_s": generated[i] if i < len(generated) else None,
                      "score_s": reward_log[i]["seconds"] if i < len(reward_log) else None,
                      "completion_length": reward_log[i]["completion_length"] if i < len(reward_log) else None,
                      "updates": n, "update_seconds": clock.seconds[i * n:(i + 1) * n],
                      "prompts": reward_log[i]["prompts"] if i < len(reward_log) else None,
                      **clock.marks[(i + 1) * n - 1]})
    last = clock.marks[-1] if clock.marks else {}
    side = {"side": "trl", "steps": steps, "updates_per_step": n, "device": device,
            "autocast": "bfloat16" if config.bf16 else None, "weights_dtype": str(weight_dtype).replace("torch.", ""),
            **{k: last.get(k) for k in ("peak_rss_gib", "peak_cuda_allocated_gib", "peak_cuda_reserved_gib")},
            "peak_rss_gib_process": peak_rss_gib(), "total_s": total,
            "prompt_tokens_identical": prompt_tokens_identical, "versions": versions(),
            "grpo_config": {k: getattr(config, k) for k in (
                "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
                "steps_per_generation", "generation_batch_size", "num_iterations", "max_steps",
                "max_completion_length", "temperature", "top_p", "top_k", "learning_rate", "beta", "epsilon",
                "loss_type", "scale_rewards", "bf16", "use_cpu", "gradient_checkpointing", "shuffle_dataset")}}
    write_json(Path(spec["out"]) / "side_trl.json", side)
    return 0


if __name__ == "__main__":
    sys.exit(main())
