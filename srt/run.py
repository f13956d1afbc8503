"""The run harness of the two training scripts (stage1_sft.py, stage2_grpo.py): everything a training
run needs that is not its paper section. A script builds its flags from the groups here and its own,
then trains inside one Run:

    run = Run(cfg, "stage1_sft.py", parser)       claim --out, set up distributed, the time budget
    run.record_data()                              --data as given and one sha256 of its bytes
    model, tokenizer = run.load_model("sft")       from the checkpoint when resuming; the memory plan
    model, train_model, optimizer = run.prepare(model)   checkpointing, DDP / FSDP, AdamW (§4.1)
    state = run.resume()                           weights, AdamW and RNG of the checkpoint, or None
    metrics = run.log("metrics.jsonl")             a resumed run keeps the lines up to its checkpoint
    while run.keep_going(step, total_steps): ...   the time budget, agreed by every rank
    run.save(step)  run.finish(step, total_steps, summary)

What a --resume must match is derived from the parser, not kept by hand: every flag of a group made
with `method_group` (the paper's settings and the departures from it: they fix the data order and
the meaning of a step), the precision (--dtype), and the run's model (its path and its files'
sha256), data and seed. The other scale and logging flags are not in it: --micro-batch-size, --fsdp
or --save-every compute the same update. A --resume refuses what it cannot continue exactly: a
checkpoint without its trainer state, a log of the steps before the checkpoint that is gone or cut,
other data or other weights under --model, and a finished run whose checkpoint was deleted is
compared with its config.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from srt import memory_plan
from srt.checkpoint import JsonlLog, check_resume_config, has_trainer_state, rng_state, set_rng_state
from srt.config import (
    MAX_STEPS,
    add_data,
    add_model,
    add_out,
    add_overwrite,
    add_resume,
    add_seed,
    at_least,
    changed_since,
    claim_out,
    interruptible,
    lock_owner,
    positive,
    run_in,
    up_to,
    write_config,
)
from srt.data_io import DataError, data_paths, files_sha256, write_json
from srt.distributed import (
    all_ranks_any,
    check_checkpoint_layout,
    gather_objects,
    load_checkpoint,
    save_checkpoint,
    save_final,
    setup_distributed,
    teardown_distributed,
    wrap_model,
)
from srt.loading import (
    GRPO_DROPOUT_NOTE,
    enable_activation_checkpointing,
    load_model_and_tokenizer,
    model_fingerprint,
    zero_dropout,
)
from srt.precision import add_dtype, resolve_dtype
from srt.training import TimeBudget, adamw

# --------------------------------------------------------------------------------------------
# Flags: the run's, the scale's and the logs' groups; a script adds its method's groups itself.
# --------------------------------------------------------------------------------------------
METHOD_GROUPS = "_srt_method_groups"  # the parser attribute that lists the groups a resume must match
RUN_IDENTITY = ("model", "data", "seed")  # of the run group: what is trained, on what, from which seed
# of the scale group: a bf16 step is another step than an fp32 one, and so is one through another
# attention kernel (stage 1's --attention: its scores in bf16); a flag a script lacks is left out
PRECISION = ("dtype", "attention")
DERIVED_IDENTITY = ("world_size", "data_sha256", "model_sha256")  # set by the run itself, not by a flag


def training_parser(description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


# What the run flags say, and default to, in each training script.
RUN_FLAGS = {
    "sft": dict(
        model_default="smollm2-135m",
        model_help="HF id, local folder, smollm2-135m or tiny-random",
        data_help="training JSONL from stage0",
        out_default="runs/demo/sft",
        resume_help="continue from <out>/checkpoint",
        max_steps_default=None,
        max_steps_help="optimizer steps in all (default: from --epochs)",
        budget_help="stop early (saved, resumable) when the next step would overrun this wall time",
    ),
    "grpo": dict(
        model_default="runs/demo/sft/final",
        model_help="the SFT policy to start from; also the frozen KL reference",
        data_help="training records, JSONL",
        out_default="runs/demo/grpo",
        resume_help="continue from <out>/checkpoint; a finished run is left as it is",
        max_steps_default=100,
        max_steps_help="GRPO steps; each is one sample batch",
        budget_help="stop early (saved, resumable) when the next step and the final evaluation would "
        "overrun this",
    ),
}


def add_run_flags(parser, stage: str):
    """--model, --data, --out, --seed, --resume, --overwrite, --max-steps, --time-budget-minutes, as
    RUN_FLAGS[stage] words and sets them."""
    text = RUN_FLAGS[stage]
    run = parser.add_argument_group("the run: model, data, output")
    add_model(run, text["model_default"], text["model_help"])
    add_data(run, "runs/data/train.jsonl", text["data_help"], mixture=True)
    add_out(run, text["out_default"])
    add_seed(run, numpy_range=True)
    add_resume(run, text["resume_help"])
    add_overwrite(run, "start afresh in an --out that holds an earlier run (without it or --resume: refused)")
    run.add_argument(
        "--max-steps", type=up_to(MAX_STEPS), default=text["max_steps_default"], help=text["max_steps_help"]
    )
    run.add_argument(
        "--time-budget-minutes", type=at_least(0.0, float), default=None, help=text["budget_help"]
    )
    return run


def method_group(parser, title: str, description: str):
    """An argument group whose every flag defines the training: a --resume must match it."""
    group = parser.add_argument_group(title, description)
    getattr(parser, METHOD_GROUPS, None) or setattr(parser, METHOD_GROUPS, [])
    getattr(parser, METHOD_GROUPS).append(group)
    return group


def add_optimizer_flags(group, *, lr: float, lr_help: str, warmup_steps: int, warmup_help: str) -> None:
    """§4.1's AdamW settings in a script's method group: --lr, --warmup-steps, --weight-decay and
    --max-grad-norm."""
    add = group.add_argument
    add("--lr", type=at_least(0.0, float), default=lr, help=lr_help)
    add("--warmup-steps", type=up_to(MAX_STEPS, low=0), default=warmup_steps, help=warmup_help)
    add("--weight-decay", type=at_least(0.0, float), default=0.0, help="AdamW weight decay")
    add("--max-grad-norm", type=positive(float), default=1.0, help="gradient clipping norm")


def add_scale_group(parser):
    """--dtype, --gradient-checkpointing and the distributed flags (srt/distributed.py)."""
    scale = parser.add_argument_group("scale: devices, precision, memory, FSDP")
    add_dtype(
        scale,
        "auto: fp32 weights with bf16 autocast on a GPU or a CPU with AMX or AVX512-BF16 (measured "
        "faster: bench/precision.py), plain fp32 elsewhere",
    )
    scale.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="trade compute for memory",
    )
    return scale


def add_log_group(parser, *, save_every_default: int, save_every_low: int):
    """--save-every; a script adds its own logs and probes to the group."""
    logs = parser.add_argument_group("logging and outputs")
    logs.add_argument(
        "--save-every",
        type=at_least(save_every_low),
        default=save_every_default,
        help="write <out>/checkpoint every N steps",
    )
    return logs


def add_distributed_flags(parser) -> None:
    """The flags both training stages share for running at scale (torchrun, FSDP), and for planning a
    run (--dry-run: srt/memory_plan.py)."""
    add = parser.add_argument
    add(
        "--fsdp",
        action="store_true",
        help="shard weights, gradients and AdamW state over the ranks (FSDP2); "
        "run under torchrun (also with one process)",
    )
    add(
        "--dist-timeout-minutes",
        type=positive(float),
        default=None,
        help="timeout of every collective and barrier (default: $SRT_DIST_TIMEOUT_MINUTES or 60)",
    )
    add("--dry-run", action="store_true", help="print the per-GPU memory plan and exit; downloads nothing")
    add(
        "--world-size",
        type=at_least(1),
        default=None,
        help="GPUs to plan for with --dry-run (default: this run's)",
    )
    add(
        "--gpu-memory-gb",
        type=positive(float),
        default=None,
        help="memory per GPU the plan must fit (default: this GPU's, else 80 as on an A100-80GB)",
    )


def finish_parser(parser, scale) -> argparse.ArgumentParser:
    add_distributed_flags(scale)
    return parser


def resume_keys(parser) -> tuple[str, ...]:
    """The settings a --resume must match: the run's model, data and seed, every flag of a method
    group, the precision (--dtype, --attention), the world size and the data's sha256."""
    method = [
        action.dest
        for group in getattr(parser, METHOD_GROUPS, [])
        for action in group._group_actions
        if action.dest != argparse.SUPPRESS
    ]
    precision = [key for key in PRECISION if key in {action.dest for action in parser._actions}]
    return tuple(dict.fromkeys((*RUN_IDENTITY, *method, *precision, *DERIVED_IDENTITY)))


# --------------------------------------------------------------------------------------------
# One training run
# --------------------------------------------------------------------------------------------
class Run:
    """The plumbing of one training run; the script's loop calls it between its equations."""

    def __init__(self, cfg, script: str, parser, reserve_s: float = 60.0):
        self.cfg, self.script, self.keys = cfg, script, resume_keys(parser)
        earlier = run_in(cfg.out) == script or lock_owner(cfg.out).get("script") == script
        # every rank checks --out before any rank can write to it: the ranks meet in setup_distributed,
        # or, for a second run in one process (its group already made), at the barrier below
        claim_out(cfg.out, script, cfg.resume, cfg.overwrite)
        self.out, self.checkpoint = Path(cfg.out), Path(cfg.out) / "checkpoint"
        if cfg.resume:
            self.refuse_a_damaged_checkpoint()
        elif cfg.overwrite and earlier:
            self.refuse_to_clear_the_model()
            self.clear_earlier_run()
        self.rank, self.world_size, _, self.device = setup_distributed(
            cfg.dist_timeout_minutes, always=cfg.fsdp
        )
        if dist.is_initialized():
            # init_process_group made the ranks meet, but only the first time: without this, a rank
            # done with an earlier run could write this run's config.json before a slower rank has
            # checked --out, which then refuses it as "already holds a run"
            dist.barrier()
        cfg.world_size = self.world_size
        self.main_process = self.rank == 0
        self.budget = TimeBudget(cfg.time_budget_minutes, reserve_s=reserve_s)
        self.model = self.optimizer = self.tokenizer = None
        self.autocast_dtype, self.start_step = None, 0

    def refuse_a_damaged_checkpoint(self) -> None:
        """A checkpoint folder without its trainer state (trainer_state.pt or .json deleted, or
        never copied) cannot be continued, and starting afresh would replace final/ without a word:
        one line instead. (A folder is swapped in whole by publish_dir, so a kill mid-save leaves
        the previous checkpoint, never such a folder.)"""
        if self.checkpoint.is_dir() and not has_trainer_state(self.checkpoint):
            missing = [
                n for n in ("trainer_state.pt", "trainer_state.json") if not (self.checkpoint / n).exists()
            ]
            sys.exit(
                f"error: --resume: the checkpoint in {self.checkpoint} is damaged ({' and '.join(missing)} "
                "missing), so the run cannot continue where it stopped; put the file back, or start afresh "
                "with --overwrite"
            )

    CLEARED = ("checkpoint", "final", "summary.json", "config.json")  # what --overwrite deletes

    def refuse_to_clear_the_model(self) -> None:
        """--overwrite would delete the --model this run trains from (--model out/final with --out
        out): the weights would be gone before they were read, and nothing could bring them back."""
        model = Path(self.cfg.model).resolve()
        for name in self.CLEARED:
            cleared = (self.out / name).resolve()
            if cleared.exists() and (model == cleared or cleared in model.parents):
                sys.exit(
                    f"error: --overwrite would delete {self.out / name}, which holds --model "
                    f"{self.cfg.model} this run trains from; copy the model to another folder and give "
                    "that as --model, or give another --out"
                )

    def clear_earlier_run(self) -> None:
        """--overwrite of an earlier run: its checkpoint, final model, summary and config go before
        this run writes anything. Kept, a run stopped before its first save would leave the earlier
        run's checkpoint as if it were its own, and that run's summary.json would call it finished."""
        if int(os.environ.get("RANK", "0")) != 0:
            return
        for name in self.CLEARED[:2]:
            shutil.rmtree(self.out / name, ignore_errors=True)
        for name in self.CLEARED[2:]:
            (self.out / name).unlink(missing_ok=True)

    def record_data(self) -> None:
        """What a resumed run must train on and from: the --data specs as given (files and weights)
        and one sha256 of the files' bytes, so other data under the same name is refused too; and
        the sha256 of a --model folder's files, so other weights under the same path are refused
        (a hub id or a built-in name stands for fixed weights: None). Every byte is read, whatever
        the size (about a second a GB, once per run): a size and a date would pass a copy that
        differs, and refuse an identical one copied to another machine."""
        cfg = self.cfg
        cfg.data = [cfg.data] if isinstance(cfg.data, str) else list(cfg.data)
        cfg.data_sha256 = files_sha256(data_paths(cfg.data))
        local = Path(cfg.model).is_dir() and cfg.model not in ("tiny-random", "smollm2-135m")
        cfg.model_sha256 = model_fingerprint(cfg.model, by_bytes_up_to=None) if local else None

    @property
    def resume_config(self) -> dict:
        return {k: getattr(self.cfg, k) for k in self.keys}

    @property
    def resuming(self) -> bool:
        return self.cfg.resume and has_trainer_state(self.checkpoint)

    def finished(self, steps: int, also=()) -> dict | None:
        """Under --resume, the summary of a run of these settings that already did `steps` steps
        (and wrote `also`), else None. Nothing is rewritten: a re-saved final/ would look like a new
        model to evaluate.py's --resume."""
        summary = self.out / "summary.json"
        if not (self.cfg.resume and summary.exists() and (self.out / "final" / "config.json").exists()):
            return None
        if has_trainer_state(self.checkpoint):  # a finished run is one of the same settings and data
            check_resume_config(self.checkpoint, self.resume_config)
        else:  # its checkpoint deleted to save disk: what its config.json recorded
            self.check_finished_config()
        done = json.loads(summary.read_text())
        if done["steps"] < steps or not all((self.out / name).exists() for name in also):
            return None
        if self.main_process:
            print(f"{self.out} already holds a finished run of {done['steps']} steps; nothing to do")
        return done

    def check_finished_config(self) -> None:
        """A finished run without its checkpoint is compared with its config.json, which holds every
        setting of resume_config: a --resume with others would call it done for settings it never
        ran. A key an older config.json lacks is not checked."""
        path = self.out / "config.json"
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        now = self.resume_config
        details = changed_since(saved, now)
        if details:
            sys.exit(
                f"error: --resume with different settings than the finished run in {self.out} (its "
                f"config.json; its checkpoint is gone): {details}; --overwrite starts afresh"
            )

    def load_model(self, stage: str, name: str | None = None, dtype: str | None = None):
        """-> (model, tokenizer): the checkpoint's weights when resuming (FSDP loads them later, into
        the shards), else --model. Under FSDP the weights load on the CPU and each rank moves only its
        shards to its GPU. `name`: another model (stage 2's pi_ref), never from the checkpoint.
        Stage 2's models come without dropout (loading.zero_dropout: pi_old runs in train mode)."""
        cfg = self.cfg
        if name is None:
            if cfg.resume and not self.resuming and self.main_process:
                print(f"note: no checkpoint in {self.checkpoint}; starting from scratch", flush=True)
            if self.resuming:  # before loading weights from it
                check_checkpoint_layout(self.checkpoint, cfg.fsdp)
        _, self.autocast_dtype = resolve_dtype(cfg.dtype, self.device)
        source = name or (str(self.checkpoint) if self.resuming and not cfg.fsdp else cfg.model)
        model, tokenizer = load_model_and_tokenizer(
            source,
            dtype or cfg.dtype,
            None if cfg.fsdp else self.device,
            getattr(cfg, "trust_remote_code", False),
        )
        if name is None and self.main_process:
            print(memory_plan.stage_plan(stage, cfg, self.world_size, model.config), flush=True)
        if stage == "grpo":  # pi_old runs in train mode: no dropout (loading.zero_dropout)
            zero_dropout(model, GRPO_DROPOUT_NOTE if name is None else None)
        return model, tokenizer

    def prepare(self, model, tokenizer):
        """Gradient checkpointing, then DDP (2+ processes) or FSDP, then §4.1's AdamW.
        -> (model: the parameters, train_model: what the loss calls, optimizer)."""
        cfg = self.cfg
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(model)
        model, train_model, self.autocast_dtype = wrap_model(
            model, self.device, self.world_size, cfg.fsdp, self.autocast_dtype
        )
        optimizer = adamw(model.parameters(), cfg.lr, cfg.weight_decay, cfg.fsdp)
        self.model, self.optimizer, self.tokenizer = model, optimizer, tokenizer
        return model, train_model, optimizer

    def resume(self) -> dict | None:
        """Load the checkpoint's optimizer state (and FSDP's shards) and this rank's RNG state.
        -> the trainer state (its "step" and what the script saved with it), or None."""
        if not self.resuming:
            return None
        cfg, model, optimizer = self.cfg, self.model, self.optimizer
        state = load_checkpoint(self.checkpoint, model, optimizer, self.resume_config, cfg.fsdp)
        set_rng_state(state["rng"][self.rank])
        self.start_step = state["step"]
        if self.main_process:
            print(f"resuming from {self.checkpoint} at step {self.start_step}", flush=True)
        return state

    def log(self, name: str, every: int | None = None) -> JsonlLog:
        """<out>/name, one JSON line per step; a resumed run drops the lines past its checkpoint.
        Every log is written (empty, if need be) when its run starts: a resumed run whose log is
        gone would go on without the lines of its first steps, so it is refused. A log written
        `every` N steps must also reach its checkpoint's last such step (log_agrees)."""
        path = self.out / name
        if self.resuming and self.start_step > 0 and not path.exists():
            sys.exit(
                f"error: --resume: {path} is gone, but the checkpoint in {self.checkpoint} is at step "
                f"{self.start_step}: the run would go on without the lines of steps 1-{self.start_step}; "
                "put the file back, or start afresh with --overwrite"
            )
        log = JsonlLog(path, keep_until_step=self.start_step if self.resuming else None)
        if self.resuming and every:
            self.log_agrees(log, every)
        if self.main_process:
            log.flush()
        return log

    def log_agrees(self, log: JsonlLog, every: int) -> None:
        """A log of a line every `every` steps must end at its checkpoint's last such step: one
        emptied or cut (by hand, or by a killed run of other settings) would go on without the lines
        of the steps before, under a config.json that does not describe them."""
        expected = self.start_step - self.start_step % every
        last = max((row["step"] for row in log.rows), default=0)
        if last < expected:
            sys.exit(
                f"error: --resume: {log.path} ends at step {last}, but the checkpoint in {self.checkpoint} "
                f"is at step {self.start_step}: the lines of steps {last + 1}-{expected} are missing; put "
                "the file back, or start afresh with --overwrite"
            )

    def write_config(self, **extra) -> None:
        """config.json, the resolved configuration; a fresh run first drops an earlier summary.json,
        which would make a --resume of this one "finished"."""
        if self.main_process:
            if not self.resuming:
                (self.out / "summary.json").unlink(missing_ok=True)
            write_config(self.out, {**vars(self.cfg), **extra, "device": str(self.device)}, self.script)

    def keep_going(self, step: int, total_steps: int) -> bool:
        return step < total_steps and not all_ranks_any(self.budget.exhausted(), self.device)

    def save(self, step: int, **state) -> None:
        """checkpoint/: weights, AdamW's moments, every rank's RNG and the script's `state`. FSDP:
        every rank writes its shards (srt/distributed.py); else rank 0 the whole state."""
        state = {"step": step, **state, "rng": gather_objects(rng_state(), self.world_size)}
        model, optimizer, fsdp = self.model, self.optimizer, self.cfg.fsdp
        save_checkpoint(self.checkpoint, model, optimizer, self.tokenizer, state, self.resume_config, fsdp)

    def save_final(self, path=None) -> Path:
        """final/ (or `path`): an ordinary save_pretrained folder, also under FSDP."""
        path = Path(path) if path else self.out / "final"
        save_final(path, self.model, self.tokenizer, self.cfg.fsdp)
        return path

    def warn_if_stopped_early(self, step: int, total_steps: int) -> None:
        if self.main_process and step < total_steps:
            print(
                f"WARNING: time budget of {self.cfg.time_budget_minutes} min reached: stopped at step "
                f"{step} of {total_steps} ({total_steps - step} steps missing); --resume continues",
                flush=True,
            )

    def write_summary(self, summary: dict) -> None:
        if self.main_process:
            write_json(self.out / "summary.json", summary)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def interrupted(out) -> str | None:
    """The line a Ctrl-C'd training run ends with (rank 0's; the other ranks say nothing): the step
    its last checkpoint holds, and how to continue from it."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    checkpoint = Path(out) / "checkpoint"
    try:
        step = json.loads((checkpoint / "trainer_state.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return (
            f"no checkpoint in {checkpoint} yet (one is written every --save-every steps); the same "
            "command with --resume starts afresh"
        )
    return f"{checkpoint} holds step {step}; the same command with --resume continues from there"


def main(cfg, stage: str, work, saved=None) -> None:
    """A training script's main: --dry-run prints the memory plan alone (nothing is loaded or
    downloaded, for a machine this need not be); else `work(cfg)`, a bad input ending in one line,
    and Ctrl-C or a full disk in one line saying where the run can be continued from (`saved()`,
    for work that is no training run: what it leaves)."""
    if cfg.dry_run:
        print(memory_plan.stage_plan(stage, cfg, cfg.world_size or int(os.environ.get("WORLD_SIZE", 1))))
        return
    try:
        with interruptible(saved or (lambda: interrupted(cfg.out)), cfg.out):
            work(cfg)
    except (DataError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    finally:
        teardown_distributed()
