"""One GRPO replicate, end to end: does GRPO raise dev recall over the SFT start it began from?

A replicate builds its own SFT start from its seed and runs GRPO from it, so replicates of different
seeds are independent by construction (they vary the SFT seed too), and each is paired against its
own start on the same dev queries. The chain, each stage a subprocess of the existing script with
`--resume`, so that a second invocation continues where the first stopped:

    stage 0   stage0_build.py --preset cpu-table2, a fixed data seed; one data folder all replicates share
    SFT       stage1_sft.py --preset cpu-long with the recipe below, --seed SEED      -> <out>/sft
    GRPO      stage2_grpo.py --preset cpu-long with the recipe below, --seed SEED     -> <out>/grpo
    placebo   stage2_grpo.py --placebo, the same flags, rewards shuffled within each group
    eval      evaluate.py: the start, the GRPO model (and the placebo) on the same dev queries, batched

    python bench/grpo_replicate.py --seed 1                 # make grpo-replicate SEED=1
    python bench/grpo_replicate.py --seed 1 --placebo       # make grpo-replicate SEED=1 PLACEBO=1

Writes <out>/result.json (default runs/replicate-SEED): the resolved config, the machine and the
dtype the runs recorded, the wall time of each stage, and the paired differences GRPO - start,
placebo - start and GRPO - placebo of recall Jaccard, F1, accuracy and the right answers whose
recall missed H*, each with its paired bootstrap 95% interval (evaluate.py's, and
bench/grpo_seeds.py's for the last), plus the per-query values bench/pool_replicates.py pools.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from grpo_seeds import MAX_F1_DROP, bypass_comparison, right_without_recall  # noqa: E402
from measure import check_out, machine  # noqa: E402

from srt.config import at_least, in_range, positive  # noqa: E402
from srt.data_io import read_jsonl, write_json  # noqa: E402

# The default recipe: the start GRPO once gained from, and the GRPO run that gained.
#   stage 0, 600 dialogues: 41-46 s (docs/experiments/table2.md, grpo-replicates.md).
#   SFT: 256 cpu-long steps, 102 on pruned histories and 154 on full ones (phase-1 share 0.4), the
#     start of dev Jaccard 49.6% from which GRPO gained +7.4 [+2.8, +12.4] (grpo-recall.md). Replicate
#     1 rebuilt it at 50.0% in 49.7 min on a 2-core Xeon with AMX (bf16 autocast: 4.5 s a pruned
#     step, 15.7 s a full one); about 62 min on the EPYC with AVX-512 (5.2 s / 20.7 s in fp32).
#     Share 0.6 (52 full steps moved to pruned ones) would save about 13 min there, but trains 408
#     full-history records instead of 616, and records on full histories are what raised dev
#     Jaccard in every start measured (grpo-replicates.md, "The SFT sweep").
#   GRPO: the cpu-long recipe (30 steps of 2 groups at lr 1e-5) with K = 8 samples a group. K = 4,
#     cpu-long's own, gained once from seed 0's start (+7.4 Jaccard) but not in replicate 1 (-0.8
#     [-4.9, +3.1]), where 38% of its groups had one recall reward for all four samples and so no
#     advantage; K = 8 from replicate 1's start halved that share (19%) and gained +5.9 [+1.4,
#     +10.3]. K = 8 is fixed here before the replicates that test it (--grpo-k 4 restores the
#     other). Median step 58-61 s on the AMX Xeon (29-32 min; 41 s at K = 4), about 110 s on the
#     AVX-512 EPYC (about 55 min, scaled from its 80 s at K = 4).
#   evaluation: 128 dev queries at batch 8, about 4 min a model on the AMX Xeon, 7 on the EPYC.
#   In all 88 min on the AMX Xeon (replicate 2, measured), about 2.3 hours on the AVX-512 EPYC;
#   --placebo adds a second GRPO run and a third evaluation (29 min on the Xeon: 117 in all). On the
#   EPYC with AVX2 alone the chain takes more than 5 hours and does not fit 150 minutes. Every value
#   is a flag.
RECIPE_DEFAULTS = dict(
    sft_steps=256,
    sft_lr=5e-5,
    sft_phase1_fraction=0.4,
    sft_batch_size=2,
    sft_grad_accum=2,
    grpo_steps=30,
    grpo_k=8,
    grpo_prompts_per_step=2,
    grpo_lr=1e-5,
)
# the flags that may change between two invocations on one replicate folder: adding the placebo
# later reuses the start, the GRPO run and their evaluated rows
MAY_CHANGE = ("placebo",)
RECORD_EVERY_S = 60  # how often a running stage writes its time so far to stages.json
COMPARED = ("jaccard", "f1", "accuracy")  # read from evaluate.py's paired comparisons


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--seed", type=at_least(0), default=1, help="the seed of this replicate's SFT and GRPO")
    p.add_argument("--out", help="the replicate's folder (default: runs/replicate-SEED)")
    p.add_argument("--placebo", action="store_true", help="also a placebo GRPO run from the same start")
    p.add_argument("--model", default="smollm2-135m", help="the base model SFT starts from")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="every stage's --dtype (auto: bf16 autocast on a GPU or a CPU with AMX or AVX512-BF16)",
    )
    data = p.add_argument_group("stage 0")
    data.add_argument(
        "--data-dir", default="runs/replicate-data", help="the data folder all replicates share"
    )
    data.add_argument("--data-seed", type=at_least(0), default=0, help="stage 0's seed, the same for all")
    data.add_argument(
        "--dialogues", type=at_least(1), default=600, help="synthetic dialogues (cpu-table2: 600)"
    )
    sft = p.add_argument_group("SFT start (stage1_sft.py --preset cpu-long, these flags win)")
    sft.add_argument("--sft-steps", type=at_least(1), default=RECIPE_DEFAULTS["sft_steps"])
    sft.add_argument("--sft-lr", type=positive(float), default=RECIPE_DEFAULTS["sft_lr"])
    sft.add_argument(
        "--sft-phase1-fraction",
        type=in_range(0.0, 1.0),
        default=RECIPE_DEFAULTS["sft_phase1_fraction"],
        help="share of the steps on pruned histories",
    )
    sft.add_argument("--sft-batch-size", type=at_least(1), default=RECIPE_DEFAULTS["sft_batch_size"])
    sft.add_argument(
        "--sft-grad-accum",
        type=at_least(1),
        default=RECIPE_DEFAULTS["sft_grad_accum"],
        help="micro-batches per step (global batch = batch size x this)",
    )
    grpo = p.add_argument_group("GRPO (stage2_grpo.py --preset cpu-long, these flags win)")
    grpo.add_argument("--grpo-steps", type=at_least(1), default=RECIPE_DEFAULTS["grpo_steps"])
    grpo.add_argument(
        "--grpo-k", type=at_least(2), default=RECIPE_DEFAULTS["grpo_k"], help="completions per prompt"
    )
    grpo.add_argument(
        "--grpo-prompts-per-step",
        type=at_least(1),
        default=RECIPE_DEFAULTS["grpo_prompts_per_step"],
        help="distinct prompts a run sees: steps x this",
    )
    grpo.add_argument("--grpo-lr", type=positive(float), default=RECIPE_DEFAULTS["grpo_lr"])
    p.add_argument(
        "--max-new-tokens",
        type=at_least(1),
        default=256,
        help="completion cap of GRPO's samples and of the evaluation (256 hold the longest SFT chain)",
    )
    ev = p.add_argument_group("evaluation (evaluate.py on dev.jsonl)")
    ev.add_argument("--eval-limit", type=at_least(1), default=128, help="dev queries, stratified (seed 0)")
    ev.add_argument(
        "--eval-min-recall",
        type=at_least(0),
        default=100,
        help="dev queries that need recall: --eval-limit grows until it holds this many",
    )
    ev.add_argument("--eval-batch-size", type=at_least(1), default=8, help="prompts per generate call")
    ev.add_argument("--bootstrap", type=at_least(1000), default=2000, help="paired bootstrap resamples")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.out = args.out or f"runs/replicate-{args.seed}"
    return args


# --------------------------------------------------------------------------------------------
# The chain: the commands, and the log that lets a second invocation skip what is done.
# --------------------------------------------------------------------------------------------
def stage_commands(cfg: dict, eval_limit: int | None) -> dict[str, list[str]]:
    """stage -> its command line. The probes, the sampled-completion logs and the evaluation's
    latency and attention extras are off: the decision reads the final dev evaluation alone."""
    py, out, data = sys.executable, Path(cfg["out"]), Path(cfg["data_dir"])
    train = str(data / "train.jsonl")
    common = ["--dtype", cfg["dtype"], "--seed", str(cfg["seed"]), "--resume"]
    grpo = [
        "--preset", "cpu-long", "--model", str(out / "sft" / "final"), "--data", train,
        "--max-steps", str(cfg["grpo_steps"]), "-K", str(cfg["grpo_k"]),
        "--prompts-per-step", str(cfg["grpo_prompts_per_step"]), "--lr", str(cfg["grpo_lr"]),
        "--max-new-tokens", str(cfg["max_new_tokens"]), "--eval-limit", "0", "--sample-every", "0", *common,
    ]  # fmt: skip
    commands = {
        "data": [
            py, str(ROOT / "stage0_build.py"), "--preset", "cpu-table2", "--out", str(data),
            "--num-dialogues", str(cfg["dialogues"]), "--seed", str(cfg["data_seed"]), "--resume", "--quiet",
        ],
        "sft": [
            py, str(ROOT / "stage1_sft.py"), "--preset", "cpu-long", "--model", cfg["model"], "--data", train,
            "--out", str(out / "sft"), "--max-steps", str(cfg["sft_steps"]), "--lr", str(cfg["sft_lr"]),
            "--phase1-fraction", str(cfg["sft_phase1_fraction"]), "--batch-size", str(cfg["sft_batch_size"]),
            "--grad-accum", str(cfg["sft_grad_accum"]), "--eval-limit", "0", *common,
        ],
        "grpo": [py, str(ROOT / "stage2_grpo.py"), *grpo, "--out", str(out / "grpo")],
    }  # fmt: skip
    if cfg["placebo"]:
        commands["placebo"] = [
            py, str(ROOT / "stage2_grpo.py"), *grpo, "--placebo", "--out", str(out / "placebo"),
        ]  # fmt: skip
    if eval_limit is not None:  # known once stage 0 has written dev.jsonl
        compare = [f"{name}=srt:{out / RUN_OF[name] / 'final'}" for name in models(cfg)]
        commands["eval"] = [
            py, str(ROOT / "evaluate.py"), "--data", str(data / "dev.jsonl"), "--out", str(out / "eval"),
            "--limit", str(eval_limit), "--seed", "0", "--batch-size", str(cfg["eval_batch_size"]),
            "--max-new-tokens", str(cfg["max_new_tokens"]),
            "--latency-per-bucket", "0", "--attention-examples", "0", "--bootstrap", str(cfg["bootstrap"]),
            "--dtype", cfg["dtype"], "--table2", "SRT=start", "--compare", *compare, "--resume", "--quiet",
        ]  # fmt: skip
    return commands


RUN_OF = {"start": "sft", "grpo": "grpo", "placebo": "placebo"}  # evaluated model -> its run folder


def models(cfg: dict) -> list[str]:
    """The evaluated models: the SFT start, its GRPO run, and the placebo when asked."""
    return ["start", "grpo"] + (["placebo"] if cfg["placebo"] else [])


def finished(stage: str, cfg: dict) -> bool:
    """Whether the stage's product is on disk (a log saying 'done' is not enough: a folder may have
    been deleted since)."""
    out, data = Path(cfg["out"]), Path(cfg["data_dir"])
    return {
        "data": all((data / f).exists() for f in ("config.json", "train.jsonl", "dev.jsonl")),
        "sft": (out / "sft" / "final" / "config.json").exists(),
        "grpo": (out / "grpo" / "summary.json").exists() and (out / "grpo" / "final").exists(),
        "placebo": (out / "placebo" / "summary.json").exists() and (out / "placebo" / "final").exists(),
        "eval": (out / "eval" / "summary.json").exists(),
    }[stage]


def run_stage(
    stage: str, command: list[str], cfg: dict, log: dict, log_path: Path, upstream_ran: bool
) -> bool:
    """Run one stage unless the log holds it done with this very command, its product is on disk and
    no stage before it ran in this invocation (a stage that ran may have rewritten what this one
    read; rerun with --resume, it redoes only what changed). Its wall time adds up over the attempts,
    recorded every RECORD_EVERY_S while it runs, so a killed-and-resumed stage counts all of it.
    -> whether it ran."""
    entry = log.get(stage, {})
    if not upstream_ran and entry.get("done") and entry.get("command") == command and finished(stage, cfg):
        print(f"[{stage}] done in an earlier invocation ({entry['seconds']:.0f} s); skipped", flush=True)
        return False
    entry = {"seconds": 0.0, "attempts": 0, **entry, "command": command}  # time adds up over commands too
    entry.update(attempts=entry["attempts"] + 1, done=False)
    before = entry["seconds"]
    print(f"[{stage}] {' '.join(command)}", flush=True)
    t0 = time.perf_counter()

    def record_time():
        entry["seconds"] = before + time.perf_counter() - t0
        log[stage] = entry
        write_json(log_path, log)

    child = subprocess.Popen(command)
    # A stopped chain must not leave its stage running: a rerun would then write beside it.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
    try:
        while True:
            try:
                rc = child.wait(timeout=RECORD_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                # a chain killed without a signal it can catch (a machine taken back)
                # still counts all but the last interval of this attempt's time
                record_time()
    except KeyboardInterrupt:  # what the stage saved stays for --resume
        child.send_signal(signal.SIGINT)
        rc = child.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    entry["done"] = rc == 0 and finished(stage, cfg)
    record_time()
    if not entry["done"]:
        sys.exit(
            f"error: stage {stage} stopped (exit code {rc}); what it saved is kept: rerun the same "
            f"command to resume (log: {log_path})"
        )
    return True


def eval_limit_for(dev_path: Path, limit: int, min_recall: int) -> tuple[int, int]:
    """The smallest limit >= `limit` whose stratified selection (evaluate.select_examples, seed 0:
    a smaller limit picks a subset of a larger one) holds `min_recall` queries that need recall.
    -> (limit, queries that need recall). Stops with one line when dev.jsonl holds too few."""
    from evaluate import select_examples

    records = read_jsonl(dev_path)
    for n in range(min(limit, len(records)), len(records) + 1):
        need = sum(1 for r in select_examples(records, n, 0) if r["recall"])
        if need >= min_recall:
            return n, need
    sys.exit(
        f"error: {dev_path} holds {len(records)} queries, {sum(1 for r in records if r['recall'])} of them "
        f"needing recall: fewer than --eval-min-recall {min_recall} (build more dialogues: --dialogues)"
    )


# --------------------------------------------------------------------------------------------
# The result: paired differences from evaluate.py's rows, per-query values for the pooling.
# --------------------------------------------------------------------------------------------
def model_rows(eval_dir: Path, names: list[str]) -> dict[str, list[dict]]:
    """<eval>/<name>.jsonl, evaluate.py's per-query rows; every model must hold the same queries."""
    rows = {name: read_jsonl(eval_dir / f"{name}.jsonl", validate=False) for name in names}
    ids = {name: sorted(r["id"] for r in rs) for name, rs in rows.items()}
    if len({tuple(v) for v in ids.values()}) != 1:
        sys.exit(f"error: the models of {eval_dir} answered different queries: rerun the eval stage")
    return rows


def paired(comparison: dict, bypass: dict | None) -> dict:
    """One comparison entry of report.compare_variants, reduced to the four measures."""
    return {**{m: comparison[m] for m in COMPARED}, "right_without_recall": bypass, "n": comparison["n"]}


def differences(eval_dir: Path, names: list[str], resamples: int) -> dict:
    """GRPO - start and placebo - start from evaluate.py's summary (its paired comparisons against
    Table 2's SRT row, the start); GRPO - placebo by the same report.compare_variants. The right
    answers whose recall missed H*: bench/grpo_seeds.py's bypass_comparison, paired by query."""
    from srt.report import compare_variants

    summary = json.loads((eval_dir / "summary.json").read_text())
    out = {}
    for name in names[1:]:
        out[f"{name}-start"] = paired(
            summary["comparisons"][name], bypass_comparison(eval_dir, "start", name)
        )
    if "placebo" in names:
        rows = model_rows(eval_dir, ["placebo", "grpo"])
        versus = compare_variants(rows, "placebo", resamples, 0)["grpo"]
        out["grpo-placebo"] = paired(versus, bypass_comparison(eval_dir, "placebo", "grpo"))
    return out


def per_query(eval_dir: Path, names: list[str]) -> dict:
    """The per-query values behind every difference, on the queries that need recall (those
    compare_variants pairs), in one order: what pool_replicates.py resamples."""
    rows = model_rows(eval_dir, names)
    ids = sorted(r["id"] for r in rows["start"] if r.get("needs_recall", bool(r["gold_recall"])))
    values = {"ids": ids}
    for name in names:
        by_id = {r["id"]: r for r in rows[name]}
        bypass = right_without_recall(rows[name])
        values[name] = {m: [by_id[i].get(m) for i in ids] for m in COMPARED}
        values[name]["right_without_recall"] = [bypass.get(i) for i in ids]
    return values


def dtype_used(config_path: Path) -> dict:
    """The precision a run computed in, as its config.json records it (stage 1 writes the resolved
    autocast dtype; where a run records only its --dtype and device, precision.resolve_dtype's rule
    for them is given, marked as such)."""
    from srt.precision import resolve_dtype

    cfg = json.loads(config_path.read_text())
    entry = {"dtype": cfg.get("dtype"), "device": cfg.get("device")}
    if "autocast_dtype" in cfg:
        entry.update(
            weight_dtype=cfg.get("weight_dtype"), autocast_dtype=cfg["autocast_dtype"], recorded=True
        )
    else:
        weight, autocast = resolve_dtype(cfg.get("dtype") or "auto", cfg.get("device") or "cpu")
        entry.update(weight_dtype=str(weight), autocast_dtype=str(autocast), recorded=False)
    return entry


def step_times(run: Path) -> dict:
    """Median seconds a step (stage 1: per phase) and the GPU's peak memory, from metrics.jsonl."""
    path = run / "metrics.jsonl"
    lines = read_jsonl(path, validate=False) if path.exists() else []
    facts = {"steps": len(lines)}
    for phase in sorted({line.get("phase") for line in lines if line.get("phase") is not None}):
        facts[f"median_step_s_phase{phase}"] = statistics.median(
            line["step_s"] for line in lines if line.get("phase") == phase
        )
    if lines:
        facts["median_step_s"] = statistics.median(line["step_s"] for line in lines)
    peaks = [line["peak_gpu_gb"] for line in lines if line.get("peak_gpu_gb") is not None]
    facts["peak_gpu_gb"] = max(peaks) if peaks else None
    return facts


def passes(diff: dict) -> bool:
    """bench/grpo_seeds.py's rule: the Jaccard interval above 0, F1 not lower by more than 2 points."""
    jac, f1 = diff["jaccard"], diff["f1"]
    return bool(
        jac["low"] is not None and jac["low"] > 0 and f1["diff"] is not None and f1["diff"] >= -MAX_F1_DROP
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = check_out(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(vars(args))
    config_path = out / "config.json"
    if config_path.exists():  # one replicate folder, one recipe
        before = json.loads(config_path.read_text())
        changed = sorted(
            k for k in set(cfg) | set(before) if k not in MAY_CHANGE and cfg.get(k) != before.get(k)
        )
        if changed:
            k = changed[0]
            sys.exit(
                f"error: {config_path} holds a replicate of another recipe ({k}: {before.get(k)!r} there, "
                f"{cfg.get(k)!r} now); give another --out"
            )
        cfg["placebo"] = cfg["placebo"] or before.get("placebo", False)  # once run, it stays in the result
    write_json(config_path, cfg)
    log_path = out / "stages.json"
    log = json.loads(log_path.read_text()) if log_path.exists() else {}

    # evaluate.py (for its query selection) imports torch and transformers, about 5 s of one core:
    # import it on the other core while stage 0 runs. A later import waits for this one.
    importer = threading.Thread(target=importlib.import_module, args=("evaluate",), daemon=True)
    importer.start()
    dev = Path(cfg["data_dir"]) / "dev.jsonl"
    ran = run_stage("data", stage_commands(cfg, None)["data"], cfg, log, log_path, False)
    importer.join()
    limit, need = eval_limit_for(dev, cfg["eval_limit"], cfg["eval_min_recall"])
    for stage, command in stage_commands(cfg, limit).items():
        if stage != "data":
            ran = run_stage(stage, command, cfg, log, log_path, ran) or ran

    eval_dir, names = out / "eval", models(cfg)
    diffs = differences(eval_dir, names, cfg["bootstrap"])
    summary = json.loads((eval_dir / "summary.json").read_text())
    runs = {
        "sft": out / "sft",
        "grpo": out / "grpo",
        **({"placebo": out / "placebo"} if cfg["placebo"] else {}),
    }
    result = {
        "seed": cfg["seed"],
        "config": cfg,
        "machine": {
            **machine(),
            "dtype": {
                **{name: dtype_used(run / "config.json") for name, run in runs.items()},
                "eval": dtype_used(eval_dir / "config.json"),
            },
        },
        "stages": {stage: {k: v for k, v in entry.items() if k != "done"} for stage, entry in log.items()},
        "runs": {name: step_times(run) for name, run in runs.items()},
        "eval": {
            "queries": summary["num_examples"],
            "need_recall": need,
            "limit": limit,
            "dir": str(eval_dir),
        },
        "models": {name: summary["variants"][name].get("needs_recall") for name in names},
        "differences": diffs,
        "passes": passes(diffs["grpo-start"]),
        "per_query": per_query(eval_dir, names),
    }
    write_json(out / "result.json", result)
    print(summary_lines(result))
    print(f"\nresult: {out / 'result.json'}")
    return result


def summary_lines(result: dict) -> str:
    """The replicate's paired differences, one line each, in points."""

    def ci(d):
        if d is None or d.get("diff") is None:
            return "-"
        return f"{100 * d['diff']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"

    lines = [f"replicate seed {result['seed']}: {result['eval']['need_recall']} dev queries that need recall"]
    for name, d in result["differences"].items():
        lines.append(
            f"  {name:<13} Jaccard {ci(d['jaccard'])}  F1 {ci(d['f1'])}  accuracy {ci(d['accuracy'])}  "
            f"right answer, recall missed H* {ci(d['right_without_recall'])}"
        )
    lines.append(
        f"  passes (Jaccard interval above 0, F1 within 2 points): {'yes' if result['passes'] else 'no'}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
