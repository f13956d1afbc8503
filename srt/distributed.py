"""Everything distributed, in one place: torchrun's set-up and the few collectives the stages use,
the one way both training stages wrap their model (DDP, FSDP or nothing), and FSDP for models that
do not fit one GPU (the paper's 7B backbone on 8 x A100-80GB, §4.1). PyTorch's own DDP and FSDP2
(`torch.distributed.fsdp.fully_shard`), no framework beyond torch.

- `setup_distributed`: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without it, one process.
- `wrap_model`: DDP over 2+ processes, FSDP with --fsdp, the model itself otherwise.
- `shard_model`: one FSDP unit per decoder layer plus the root (embeddings, final norm, lm_head);
  a frozen model (pi_ref) reshards its root after each forward too, having no backward to do it.
  Each rank keeps 1/N of the fp32 master weights, of the gradients and, since AdamW is built on
  the sharded parameters, of AdamW's two moments. On a GPU a MixedPrecisionPolicy all-gathers bf16
  copies for compute and reduce-scatters gradients in fp32.
- `full_weights`: every unit gathered once for a whole `generate` call (rollouts, evaluation);
  `plain_module` is the model over those gathered tensors without FSDP, what the decode loop runs.
- `accumulate`: the gradient-accumulation context (DDP's no_sync; nothing under FSDP).
- checkpoints: `save_sharded` / `load_sharded` write and read every rank's shards with
  torch.distributed.checkpoint (DCP) beside the usual trainer_state files; `save_full` gathers the
  full state dict to rank 0 and writes an ordinary save_pretrained folder (final/) that
  evaluate.py and the other stages load without FSDP.
"""

from __future__ import annotations

import copy
import os
import shutil
import weakref
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from srt.checkpoint import publish_dir, swap_in
from srt.data_io import write_json

# --------------------------------------------------------------------------------------------
# Distributed set-up: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without it, one process.
# --------------------------------------------------------------------------------------------
DEFAULT_TIMEOUT_MINUTES = 60.0


def setup_distributed(timeout_minutes: float | None = None, always: bool = False):
    """-> (rank, world_size, local_rank, device). nccl on GPUs, gloo on CPUs. Under torchrun a
    process group is made when there are 2+ processes, or always (`always`, FSDP on one process).

    The collective timeout (`timeout_minutes`, else $SRT_DIST_TIMEOUT_MINUTES, else 60) bounds
    every barrier: while rank 0 writes a 7B checkpoint (about 91 GB with AdamW's moments, minutes
    on a network disk) the others wait at one, and torch's default (10 minutes) would kill them."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        # One GPU per rank: NCCL refuses two ranks on one GPU, and CUDA's own error would come later
        # and say less.
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(
                f"error: LOCAL_RANK {local_rank} needs {local_rank + 1} GPUs; {torch.cuda.device_count()} "
                "visible: start at most that many processes per node (torchrun --nproc_per_node), or "
                'hide the GPUs (CUDA_VISIBLE_DEVICES="") to run on CPUs'
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if timeout_minutes is None:
        timeout_minutes = float(os.environ.get("SRT_DIST_TIMEOUT_MINUTES", DEFAULT_TIMEOUT_MINUTES))
    under_torchrun = "MASTER_ADDR" in os.environ
    if (world_size > 1 or (always and under_torchrun)) and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=timeout_minutes)
        )
    return rank, world_size, local_rank, device


def teardown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_main_process() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def gather_objects(obj, world_size: int) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if world_size == 1:
        return [obj]
    objects = [None] * world_size
    dist.all_gather_object(objects, obj)
    return objects


def all_ranks_any(flag: bool, device) -> bool:
    """True on every rank if it is true on one: every rank must take the same branch."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


SHARDED_DIR = "sharded"  # the DCP folder inside a checkpoint of an FSDP run


def wrap_model(model, device, world_size: int, fsdp: bool, autocast_dtype):
    """The one way both training stages wrap the model they train. -> (model, train_model,
    autocast_dtype): `model` holds the parameters (1/N of them under FSDP) for the optimizer, the
    checkpoints and generation; `train_model` is what the loss calls: DDP over 2+ processes (its
    backward all-reduces the gradients), else the model itself. Under FSDP the MixedPrecisionPolicy
    computes in bf16 where autocast would have, so autocast goes off."""
    if fsdp:
        model = shard_model(model, device, autocast_dtype)
        return model, model, None
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        return model, DistributedDataParallel(model, device_ids=device_ids), autocast_dtype
    return model, model, autocast_dtype


def is_fsdp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model):
    """The repeated blocks of a causal LM (Llama, Qwen2, SmolLM2: model.model.layers)."""
    return model.get_decoder().layers


def is_frozen(model) -> bool:
    """No parameter trains (stage 2's pi_ref): the model never runs a backward pass."""
    return not any(p.requires_grad for p in model.parameters())


def shard_model(model, device, compute_dtype=None):
    """fully_shard on each decoder layer, then on the root. compute_dtype bf16: the units gather bf16
    copies for forward and backward and reduce gradients in fp32 (the weights stay as they are,
    fp32 masters). None: compute in the weights' own dtype (the CPU tests, so results compare
    exactly with one process). Returns the model, now an FSDPModule whose parameters are DTensors.

    The root unit (embeddings, final norm, lm_head). Left to itself, FSDP2 does not reshard the root
    after its forward: in training the backward needs those weights at once, so freeing them would
    only gather them again. The backward then reshards them. A frozen model (stage 2's pi_ref, its
    every parameter requires_grad False: call requires_grad_(False) before this) never runs a
    backward, so nothing would ever free its gathered root: pi_ref would hold its whole embeddings
    and lm_head for the run, 2 x 152064 x 3584 bf16 numbers = 2.2 GB on every GPU for Qwen2.5-7B
    where memory_plan.py budgets 1/N of them (1.9 GB more a GPU on 8). So a frozen model's root
    reshards after each forward, as its layers do; the price is one all-gather of the root per
    pi_ref forward, as each layer already costs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise SystemExit(
            "error: --fsdp needs torchrun (e.g. torchrun --nproc_per_node=8 ...; "
            "--nproc_per_node=1 on one GPU)"
        )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype is not None
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # None: FSDP's own choice (the root stays gathered until its backward); True: reshard the root
    # after every forward, for a model that has no backward.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True if is_frozen(model) else None)
    return model


@contextmanager
def full_weights(model):
    """Inside: every FSDP unit unsharded (one all-gather each) and kept so for every forward pass,
    so that `generate`'s decode steps run with no collective at all; on exit the full copies are
    freed. Without this, FSDP would all-gather each layer at every decode step: 28 all-gathers of
    ~0.5 GB per new token of a 7B model. Cost: a full copy of the weights in the compute dtype on
    every rank while inside (2 bytes per parameter in bf16: 15.2 GB for Qwen2.5-7B), next to the
    rollouts' KV cache; memory_plan.py counts it. `generate` decodes on `plain_module(model)`, the
    same tensors without FSDP's hooks. Since no forward pass communicates, ranks may also decode for
    different numbers of steps. A plain module passes through."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield model
        return
    # Every all-gather issued before the first wait: their latencies overlap. The memory is the same
    # as one unit at a time: a unit's gathered buffer becomes its parameters at its wait.
    for handle in [unit.unshard(async_op=True) for unit in units]:
        handle.wait()
    model.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
        model.set_reshard_after_forward(True)
        if not is_frozen(model):  # the root's setting of shard_model: see its docstring
            model.set_reshard_after_forward(False, recurse=False)  # FSDP's own choice for the root


def is_gathered(model) -> bool:
    """Does every parameter of this FSDP model hold its full tensor now (inside full_weights)?
    Sharded parameters are DTensors."""
    return not any(hasattr(p, "to_local") for p in model.parameters())


_PLAIN_MODULES = weakref.WeakKeyDictionary()  # an FSDP model -> its plain module


def plain_module(model):
    """The gathered FSDP model as a module of its own class without FSDP: built once on the meta
    device (no memory), then every parameter and buffer is the FSDP model's own tensor object, so
    nothing is copied (tied weights stay one tensor). Call it inside full_weights, where those
    tensors are the full weights in FSDP's compute dtype. Its forward runs none of FSDP's hooks, which
    synchronise streams, swap parameters and keep autograd state, so the decode loop can run it in
    inference mode, with the grouped step and under a CUDA graph, as it runs a model without FSDP.
    After the gather it still holds FSDP's unsharded tensors, whose storage FSDP has freed; the next
    call points it at the tensors of the next gather."""
    from torch.distributed.fsdp import FSDPModule

    if not is_gathered(model):
        raise RuntimeError("plain_module: the FSDP model is sharded; call it inside full_weights")
    plain = _PLAIN_MODULES.get(model)
    if plain is None:
        plain_class = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
        with torch.device("meta"):
            plain = plain_class(copy.deepcopy(model.config))
        plain.generation_config = model.generation_config
        _PLAIN_MODULES[model] = plain.eval()
    modules = dict(plain.named_modules())
    for name, module in model.named_modules():
        modules[name]._parameters.update(module._parameters)
        modules[name]._buffers.update(module._buffers)
    if any(t.is_meta for t in (*plain.parameters(), *plain.buffers())):
        raise RuntimeError(f"plain_module: {type(plain).__name__} has tensors the FSDP model lacks")
    return plain


def accumulate(model, sync: bool):
    """The context of a backward pass that should not yet all-reduce (gradient accumulation):
    DDP's no_sync. FSDP reduce-scatters after every micro-batch instead, which keeps the gradients
    sharded (skipping the reduction would hold unsharded fp32 gradients, 4 bytes per parameter)."""
    if sync or not hasattr(model, "no_sync"):
        return nullcontext()
    return model.no_sync()


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ that returns a plain tensor also for FSDP's DTensor gradients."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# --------------------------------------------------------------------------------------------
# Checkpoints of sharded runs
# --------------------------------------------------------------------------------------------
def is_sharded_checkpoint(path) -> bool:
    return (Path(path) / SHARDED_DIR).is_dir()


def check_checkpoint_layout(path, fsdp: bool) -> None:
    """A checkpoint is resumed in the layout it was written in: --fsdp writes shards, a plain run
    a save_pretrained folder. Not part of the objective (RESUME_MUST_MATCH), only of the files."""
    if is_sharded_checkpoint(path) != fsdp:
        written = "with --fsdp" if is_sharded_checkpoint(path) else "without --fsdp"
        raise SystemExit(f"error: {path} was written {written}; resume it the same way")


def save_sharded(path, model, optimizer, tokenizer, trainer_state: dict, resume_config: dict) -> None:
    """Every rank writes its shards of the weights and of AdamW's state (DCP) into a folder beside
    `path`; rank 0 adds config, tokenizer and the trainer files, then swaps it in for `path`. A
    collective: every rank calls it. No rank holds more than its shards at any point."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp.sharded"
    main = dist.get_rank() == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(tmp / SHARDED_DIR))
    dist.barrier()
    if main:
        model.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save(trainer_state, tmp / "trainer_state.pt")
        write_json(tmp / "trainer_state.json", {"step": trainer_state["step"], "config": resume_config})
        swap_in(tmp, path)
    dist.barrier()


def load_sharded(path, model, optimizer) -> None:
    """Read this rank's shards of the weights and of AdamW's state from `path` into the sharded
    model and optimizer (get_state_dict creates AdamW's lazily made state first, so DCP has
    tensors to load into)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(Path(path) / SHARDED_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def save_full(path, model, tokenizer) -> None:
    """final/ of an FSDP run: the full state dict gathered to rank 0's host memory (4 bytes per
    parameter: 30 GB for a 7B model) and written as an ordinary save_pretrained folder. A
    collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:

        def write(tmp):
            model.save_pretrained(tmp, state_dict=full, safe_serialization=True)
            tokenizer.save_pretrained(tmp)

        publish_dir(Path(path), write)
    dist.barrier()


# --------------------------------------------------------------------------------------------
# What the stages call: one path for sharded and plain runs
# --------------------------------------------------------------------------------------------
def save_checkpoint(path, model, optimizer, tokenizer, state: dict, resume_config: dict, fsdp: bool) -> None:
    """checkpoint/: sharded (every rank writes its shards) or plain (rank 0 writes save_pretrained
    weights and the whole optimizer state). Every rank calls it."""
    from srt.checkpoint import save_model

    if fsdp:
        save_sharded(path, model, optimizer, tokenizer, state, resume_config)
    elif not dist.is_initialized() or dist.get_rank() == 0:
        save_model(path, model, tokenizer, dict(state, optimizer=optimizer.state_dict()), resume_config)
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(path, model, optimizer, resume_config: dict, fsdp: bool) -> dict:
    """The trainer state of checkpoint/ (after the resume check) with the optimizer state, and under
    FSDP the weights too, loaded into `model` and `optimizer`."""
    from srt.checkpoint import load_trainer_state

    check_checkpoint_layout(path, fsdp)
    state = load_trainer_state(path, resume_config)
    if fsdp:
        load_sharded(path, model, optimizer)
    else:
        optimizer.load_state_dict(state["optimizer"])
    return state


def save_final(path, model, tokenizer, fsdp: bool) -> None:
    """final/: an ordinary save_pretrained folder either way (gathered to rank 0 under FSDP)."""
    from srt.checkpoint import save_model

    if fsdp:
        save_full(path, model, tokenizer)
    elif not dist.is_initialized() or dist.get_rank() == 0:
        save_model(path, model, tokenizer)
