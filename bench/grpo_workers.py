"""The two sides of bench/grpo_vs_trl.py, each run in its own process by the parent, so that each
peak memory is its own:

    python bench/grpo_workers.py ours --spec <out>/spec.json --run '{...}'      (the main venv)
    .venv-trl/bin/python bench/grpo_workers.py trl --spec <out>/spec.json --run '{...}'

Each reads the shared settings (spec.json), installs its instruments (forward hooks reading the
precision of the last decoder layer, a clock and token counter around transformers' generate,
timers around the log-prob passes), trains, and writes its report (JSON) where the run says. What
is measured, and why: the docstring of grpo_vs_trl.py.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import shutil
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from grpo_vs_trl import digest, trl_install_hint  # noqa: E402
from measure import peak_rss_gib  # noqa: E402

from srt.data_io import read_jsonl, write_json  # noqa: E402


# --------------------------------------------------------------------------------------------
# Reports: memory marks, versions, the reward as TRL calls it
# --------------------------------------------------------------------------------------------
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
    record. Returns the total reward R = format + recall + answer (Eq. (4)) per completion. When
    `log` is a list, one entry per call is appended: start time, seconds, the distinct prompts
    (digests, in order) and every completion's token count as TRL reports it."""

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
            lengths = [len(ids) for ids in completion_ids] if completion_ids is not None else None
            log.append(
                {
                    "start": start,
                    "seconds": time.perf_counter() - start,
                    "prompts": list(dict.fromkeys(digest(p) for p in prompts)),
                    "completion_lengths": lengths,
                }
            )
        return [t if math.isfinite(t) else None for t in totals]  # TRL turns None into NaN

    return srt_reward


# --------------------------------------------------------------------------------------------
# Instruments installed in a worker: precision hooks, a clock around transformers' generate
# --------------------------------------------------------------------------------------------
class Instruments:
    """Per-process records, filled by hooks and wrappers; plain data, written into the side's report."""

    def __init__(self, sync=None):
        self.sync = sync or (lambda: None)
        self.generating = threading.local()
        self.dtypes = {}  # model tag -> phase -> {"matmul": set, "layer_output": set}
        self.generate_calls = []  # {start, seconds, rows, prompt_width, lengths}
        self.timed = []  # {start, seconds, kind}: old / ref log-probs, loss forward
        self.stop_ids = None

    def phase(self) -> str:
        import torch

        if getattr(self.generating, "on", False):
            return "generate"
        return "loss" if torch.is_grad_enabled() else "logprobs"

    def hook_precision(self, model, tag: str) -> None:
        """Forward hooks on the last decoder layer and on its last matmul (nn.Linear)."""
        import torch

        layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        if not layers:
            raise RuntimeError(f"{type(model).__name__}: no *DecoderLayer module to watch")
        linears = [m for m in layers[-1].modules() if isinstance(m, torch.nn.Linear)]

        def recorder(kind):
            def hook(module, inputs, output):
                tensor = output[0] if isinstance(output, (tuple, list)) else output
                if isinstance(tensor, torch.Tensor):
                    seen = self.dtypes.setdefault(tag, {}).setdefault(self.phase(), {})
                    seen.setdefault(kind, set()).add(str(tensor.dtype).replace("torch.", ""))

            return hook

        layers[-1].register_forward_hook(recorder("layer_output"))
        if linears:
            linears[-1].register_forward_hook(recorder("matmul"))

    def wrap_generate(self) -> None:
        """Time transformers' generate and our decode loop (srt/decode.py, generation.generate's
        default engine), and count each row's tokens up to its first stop token."""
        from transformers.generation.utils import GenerationMixin

        from srt import decode
        from srt.generation import completion_mask

        instruments = self

        # `original`: the function wrapped; both take (model, input_ids, ...) and return the sequences
        # (decode.decode with with_logprobs: the sequences and the sampler's log-probs)
        def generate(model, *args, original=GenerationMixin.generate, **kwargs):
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            instruments.sync()
            start = time.perf_counter()
            instruments.generating.on = True
            try:
                output = original(model, *args, **kwargs)
            finally:
                instruments.generating.on = False
            instruments.sync()
            seconds = time.perf_counter() - start
            sequences = output[0] if isinstance(output, tuple) else output
            sequences = sequences if hasattr(sequences, "shape") else sequences.sequences
            width = input_ids.shape[1] if input_ids is not None else 0
            new = sequences[:, width:]
            lengths = (
                completion_mask(new, instruments.stop_ids).sum(1).tolist() if instruments.stop_ids else None
            )
            instruments.generate_calls.append(
                {
                    "start": start,
                    "seconds": seconds,
                    "rows": int(sequences.shape[0]),
                    "prompt_width": int(width),
                    "new_width": int(new.shape[1]),
                    "lengths": lengths,
                }
            )
            return output

        GenerationMixin.generate = generate
        decode.decode = functools.partial(generate, original=decode.decode)

    def timed_call(self, kind: str, fn, *args, **kwargs):
        self.sync()
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        self.sync()
        self.timed.append({"start": start, "seconds": time.perf_counter() - start, "kind": kind})
        return result

    def by_model(self) -> dict:
        return {
            tag: {
                phase: {kind: sorted(seen) for kind, seen in kinds.items()} for phase, kinds in phases.items()
            }
            for tag, phases in self.dtypes.items()
        }

    def observed(self) -> dict:
        """phase -> {matmul: [...], layer_output: [...]}, over every model of the process."""
        merged = {}
        for phases in self.dtypes.values():
            for phase, kinds in phases.items():
                for kind, seen in kinds.items():
                    merged.setdefault(phase, {}).setdefault(kind, set()).update(seen)
        return {
            phase: {kind: sorted(seen) for kind, seen in kinds.items()} for phase, kinds in merged.items()
        }


def split_steps(steps: list[dict], instruments: Instruments, rewards: list[dict] | None = None) -> None:
    """Attach to each step (with its [t0, t1] window) the generate calls, the timed log-prob passes
    and the reward calls that started inside it; derive the split and the token counts."""

    def started_inside(event: dict, step: dict) -> bool:
        return step["t0"] <= event["start"] <= step["t1"]

    for step in steps:
        calls = [c for c in instruments.generate_calls if started_inside(c, step)]
        timed = [t for t in instruments.timed if started_inside(t, step)]
        step["decode_s"] = sum(c["seconds"] for c in calls) if calls else None
        lengths = [n for c in calls for n in (c["lengths"] or [])]
        step["completion_lengths"] = lengths or None
        step["longest_completion"] = max(lengths) if lengths else None
        step["completion_length"] = sum(lengths) / len(lengths) if lengths else step.get("completion_length")
        step["generate_calls"] = [
            {k: c[k] for k in ("seconds", "rows", "prompt_width", "new_width")} for c in calls
        ]
        for kind in ("old_logprobs", "ref_logprobs", "loss_forward"):
            step[f"{kind}_s"] = sum(t["seconds"] for t in timed if t["kind"] == kind)
        if rewards is not None:
            mine = [r for r in rewards if started_inside(r, step)]
            step["score_s"] = sum(r["seconds"] for r in mine) if mine else None
            step["prompts"] = [p for r in mine for p in r["prompts"]] or None
            reported = [n for r in mine for n in (r["completion_lengths"] or [])]
            step["reported_completion_lengths"] = reported or None
        parts = [
            step.get(k)
            for k in ("generate_s", "score_s", "old_logprobs_s", "ref_logprobs_s", "loss_forward_s")
        ]
        step["rest_s"] = step["seconds"] - sum(parts) if None not in parts else None


# --------------------------------------------------------------------------------------------
# Worker: ours (stage2_grpo.train, its metrics.jsonl, wrappers installed from outside)
# --------------------------------------------------------------------------------------------
def run_ours(spec: dict, run: dict) -> int:
    import torch

    from srt import embedder, generation, loading

    cuda = torch.cuda.is_available()
    instruments = Instruments(torch.cuda.synchronize if cuda else None)
    instruments.wrap_generate()
    run_dir = Path(run["dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [
        "--model",
        spec["model_dir"],
        "--data",
        spec["data"],
        "--out",
        str(run_dir),
        "--seed",
        str(spec["seed"]),
        "--max-steps",
        str(spec["steps"]),
        "-K",
        str(spec["num_generations"]),
        "--prompts-per-step",
        str(spec["prompts_per_step"]),
        "--sample-ratio",
        str(spec["sample_ratio"]),
        "--mu",
        str(spec["mu"]),
        "--max-new-tokens",
        str(spec["max_new_tokens"]),
        "--max-prompt-length",
        str(spec["max_prompt_length"]),
        "--temperature",
        str(spec["temperature"]),
        "--top-p",
        str(spec["top_p"]),
        "--lr",
        str(spec["lr"]),
        "--warmup-steps",
        "0",
        "--weight-decay",
        "0",
        "--max-grad-norm",
        "1.0",
        "--beta",
        str(spec["beta"]),
        "--clip-eps",
        str(spec["clip_eps"]),
        "--loss-type",
        spec["loss_type"],
        "--scale-rewards",
        spec["scale_rewards"],
        "--dtype",
        "float32" if run["precision"] == "fp32" else "auto",
        "--gradient-checkpointing" if spec["gradient_checkpointing"] else "--no-gradient-checkpointing",
        "--eval-limit",
        "0",
        "--sample-every",
        "0",
        "--save-every",
        "0",
    ]

    loaded = []
    load = loading.load_model_and_tokenizer

    def load_and_watch(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        # Equal work: no stop token can be sampled, so every completion runs to --max-new-tokens.
        instruments.stop_ids = generation.stop_token_ids(model, tokenizer)
        model.generation_config.suppress_tokens = list(instruments.stop_ids)
        instruments.hook_precision(model, f"model{len(loaded)}")
        loaded.append(model)
        return model, tokenizer

    roles = {}
    real_logprobs = generation.completion_logprobs

    def timed_logprobs(model, *args, **kwargs):
        if torch.is_grad_enabled():
            kind = "loss_forward"
        else:
            kind = "ref_logprobs" if model is roles.get("ref") else "old_logprobs"
        return instruments.timed_call(kind, real_logprobs, model, *args, **kwargs)

    # The loads and the log-prob passes are timed in srt/loading.py and srt/generation.py, before the
    # run harness (srt/run.py, which loads the models) and stage 2 (which scores the log-probs) import
    # the two names from them (this process has imported neither yet; checked after).
    if "stage2_grpo" in sys.modules or "srt.run" in sys.modules:
        sys.exit("error: the ours worker must import stage2_grpo itself, after its instruments")
    loading.load_model_and_tokenizer = load_and_watch
    generation.completion_logprobs = timed_logprobs
    import stage2_grpo
    from srt import run as run_harness

    if (run_harness.load_model_and_tokenizer, stage2_grpo.completion_logprobs) != (
        load_and_watch,
        timed_logprobs,
    ):
        sys.exit("error: srt/run.py no longer imports load_model_and_tokenizer, or stage 2 "
                 "completion_logprobs, from srt.loading, srt.policy; update")  # fmt: skip

    windows = []
    grpo_step = stage2_grpo.grpo_step
    signature = inspect.signature(grpo_step)

    def marked_grpo_step(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        roles["ref"] = bound["models"].ref_model
        instruments.sync()
        t0 = time.perf_counter()
        result = grpo_step(*args, **kwargs)
        instruments.sync()
        windows.append(
            {
                "t0": t0,
                "t1": time.perf_counter(),
                "prompts": [digest(p) for p in bound["prompts"]],
                **memory_mark(),
            }
        )
        return result

    embedder.load_embedder()  # both sides carry the embedder, whether or not a sample reaches `Final answer:`
    start = time.perf_counter()
    stage2_grpo.train(stage2_grpo.parse_args(argv), step_fn=marked_grpo_step)
    total = time.perf_counter() - start

    metrics = read_jsonl(run_dir / "metrics.jsonl", validate=False)
    if not metrics or "step_s" not in metrics[0]:
        sys.exit(
            f"error: {run_dir / 'metrics.jsonl'} has no step_s: stage 2's log changed; update the ours worker"
        )
    steps = [
        {
            "step": m["step"],
            "seconds": m["step_s"],
            "generate_s": m.get("generate_s"),
            "score_s": m.get("score_s"),
            "train_s": m.get("train_s"),
            "reported_completion_length": m.get("completion_length"),
            "updates": m.get("updates"),
            **window,
        }
        for m, window in zip(metrics, windows)
    ]
    split_steps(steps, instruments)
    for bulky in ("checkpoint", "final"):  # two copies of the weights the benchmark does not need
        shutil.rmtree(run_dir / bulky, ignore_errors=True)
    last = windows[-1] if windows else {}
    side = {
        "side": "ours",
        "precision": run["precision"],
        "repeat": run["repeat"],
        "steps": steps,
        "updates_per_step": spec["updates_per_step"],
        "device": "cuda" if cuda else "cpu",
        "observed": instruments.observed(),
        "observed_by_model": instruments.by_model(),
        "stop_ids": instruments.stop_ids,
        "embedder_loaded": True,
        **{k: last.get(k) for k in ("peak_rss_gib", "peak_cuda_allocated_gib", "peak_cuda_reserved_gib")},
        "peak_rss_gib_process": peak_rss_gib(),
        "total_s": total,
        "argv": argv,
        "versions": versions(),
        "torch_threads": torch.get_num_threads(),
    }
    write_json(run["report"], side)
    return 0


# --------------------------------------------------------------------------------------------
# Worker: TRL (GRPOTrainer with the mapped config, a step clock, timed private methods)
# --------------------------------------------------------------------------------------------
def run_trl(spec: dict, run: dict) -> int:
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        sys.exit(f"error: {e}; {trl_install_hint()}")
    import torch

    from srt.embedder import load_embedder
    from srt.generation import stop_token_ids
    from srt.loading import load_model_and_tokenizer

    for method in ("_generate", "_get_per_token_logps_and_entropies"):
        if not hasattr(GRPOTrainer, method):
            sys.exit(
                f"error: this TRL has no GRPOTrainer.{method}, which the benchmark times; "
                f"use the version bench/requirements-trl.txt pins"
            )
    cuda = torch.cuda.is_available()
    instruments = Instruments(torch.cuda.synchronize if cuda else None)
    instruments.wrap_generate()
    # The same loader as ours: pad token, ChatML fallback, <|im_end|> among the stop tokens.
    model, tokenizer = load_model_and_tokenizer(spec["model_dir"], dtype="float32")
    instruments.stop_ids = stop_token_ids(model, tokenizer)
    instruments.hook_precision(model, "policy")
    rows = read_jsonl(spec["trl_prompts"], validate=False)
    prompt_tokens_identical = all(
        tokenizer(text=r["prompt"])["input_ids"]
        == tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
        for r in rows
    )

    K, P, S, mu = spec["num_generations"], spec["prompts_per_step"], spec["minibatches"], spec["mu"]
    run_dir = Path(run["dir"])
    shutil.rmtree(run_dir, ignore_errors=True)
    config = GRPOConfig(
        output_dir=str(run_dir),
        seed=spec["seed"],
        data_seed=spec["seed"],
        num_generations=K,
        per_device_train_batch_size=P * K // S,
        gradient_accumulation_steps=1,
        steps_per_generation=S,
        num_iterations=mu,
        max_steps=spec["steps"] * S * mu,
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        beta=spec["beta"],
        epsilon=spec["clip_eps"],
        loss_type={"grpo": "grpo", "dapo": "bnpo", "dr_grpo": "dr_grpo"}[spec["loss_type"]],
        scale_rewards=spec["scale_rewards"],
        shuffle_dataset=False,
        gradient_checkpointing=spec["gradient_checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False},
        # Equal work: no stop token can be sampled, so every completion runs to max_completion_length.
        generation_kwargs={"suppress_tokens": list(instruments.stop_ids)},
        bf16=run["precision"] == "bf16",
        fp16=False,
        use_cpu=not cuda,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        log_completions=False,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )

    updates = []  # per optimizer update: {start, seconds, mark}

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            instruments.sync()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            instruments.sync()
            updates.append({"start": self.start, "end": time.perf_counter(), **memory_mark()})

    generated = []  # {start, seconds}: _generate = tokenize + generate + decode, as generation.generate

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            instruments.sync()
            start = time.perf_counter()
            result = super()._generate(prompts)
            instruments.sync()
            generated.append({"start": start, "seconds": time.perf_counter() - start})
            return result

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            if torch.is_grad_enabled():
                kind = "loss_forward"
            else:
                kind = "ref_logprobs" if model is self.ref_model else "old_logprobs"
            return instruments.timed_call(
                kind, super()._get_per_token_logps_and_entropies, model, *args, **kwargs
            )

    reward_log = []
    load_embedder()  # both sides carry the embedder, whether or not a sample reaches `Final answer:`
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=make_trl_reward(log=reward_log),
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    if trainer.ref_model is not None:
        instruments.hook_precision(trainer.ref_model, "ref")
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    if run_dir.exists() and not any(run_dir.iterdir()):  # save_strategy "no": nothing was written
        run_dir.rmdir()

    n = S * mu  # optimizer updates per GRPO step
    steps = []
    for i in range(len(updates) // n):
        mine = updates[i * n : (i + 1) * n]
        t0, t1 = mine[0]["start"], mine[-1]["end"]
        gen = [g for g in generated if t0 <= g["start"] <= t1]
        steps.append(
            {
                "step": i + 1,
                "t0": t0,
                "t1": t1,
                "seconds": sum(u["end"] - u["start"] for u in mine),
                "generate_s": sum(g["seconds"] for g in gen) if gen else None,
                "updates": n,
                "update_seconds": [u["end"] - u["start"] for u in mine],
                **{k: v for k, v in mine[-1].items() if k not in ("start", "end")},
            }
        )
    split_steps(steps, instruments, rewards=reward_log)
    last = updates[-1] if updates else {}
    side = {
        "side": "trl",
        "precision": run["precision"],
        "repeat": run["repeat"],
        "steps": steps,
        "updates_per_step": n,
        "device": "cuda" if cuda else "cpu",
        "observed": instruments.observed(),
        "observed_by_model": instruments.by_model(),
        "stop_ids": instruments.stop_ids,
        "embedder_loaded": True,
        **{k: last.get(k) for k in ("peak_rss_gib", "peak_cuda_allocated_gib", "peak_cuda_reserved_gib")},
        "peak_rss_gib_process": peak_rss_gib(),
        "total_s": total,
        "prompt_tokens_identical": prompt_tokens_identical,
        "versions": versions(),
        "torch_threads": torch.get_num_threads(),
        "grpo_config": {
            k: getattr(config, k)
            for k in (
                "num_generations",
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "steps_per_generation",
                "generation_batch_size",
                "num_iterations",
                "max_steps",
                "max_completion_length",
                "temperature",
                "top_p",
                "top_k",
                "learning_rate",
                "beta",
                "epsilon",
                "loss_type",
                "scale_rewards",
                "bf16",
                "use_cpu",
                "gradient_checkpointing",
                "shuffle_dataset",
                "generation_kwargs",
                "cast_lm_head_to_fp32",
            )
        },
    }
    write_json(run["report"], side)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="One side of bench/grpo_vs_trl.py (started by it).")
    p.add_argument("side", choices=["ours", "trl"])
    p.add_argument("--spec", required=True, help="<out>/spec.json written by grpo_vs_trl.py")
    p.add_argument("--run", required=True, help="JSON: precision, repeat, dir, report")
    args = p.parse_args(argv)
    spec, run = json.loads(Path(args.spec).read_text()), json.loads(args.run)
    return run_ours(spec, run) if args.side == "ours" else run_trl(spec, run)


if __name__ == "__main__":
    sys.exit(main())
