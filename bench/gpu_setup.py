"""What bench/gpu_check.sh and bench/gpu_rollouts.sh need before they measure, on a GPU machine that
may have no package registry (docs/gpu.md):

    python bench/gpu_setup.py check-transformers
        stops unless transformers is at least requirements.txt's pin: an older one takes the KV
        cache under another name (past_key_values), and the decode loop stops at its first prefill
    python bench/gpu_setup.py export-shape MODEL DIR
        where the weights are: MODEL's config, generation config and tokenizer, no weights (3.5 MB
        for the embedded SmolLM2-135M, whose weights are a 98 MB package)
    python bench/gpu_setup.py random-weights DIR OUT
        there: a save_pretrained folder with DIR's shape and random weights (seed 0)

Speed and memory depend on the shapes, not on the weights' values, so random weights of the real
shape measure both; they cannot show learning.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def check_transformers() -> None:
    import transformers

    pins = (ROOT / "requirements.txt").read_text().splitlines()
    pinned = next(line.split("==")[1].strip() for line in pins if line.startswith("transformers=="))

    def numbers(version):
        return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())

    if numbers(transformers.__version__) < numbers(pinned):
        sys.exit(
            f"error: transformers {transformers.__version__} is older than requirements.txt's {pinned}: "
            "install that wheel first (docs/gpu.md)"
        )


def export_shape(model_name: str, folder: str) -> None:
    from srt.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_name, dtype="float32")
    for part in (model.config, model.generation_config, tokenizer):
        part.save_pretrained(folder)
    print(f"{model_name}'s config and tokenizer, no weights: {folder}")


def random_weights(shape: str, out: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape))
    model.generation_config = GenerationConfig.from_pretrained(shape)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(shape).save_pretrained(out)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"random weights of {shape}'s shape: {millions:.1f}M parameters in {out}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check-transformers")
    export = commands.add_parser("export-shape")
    export.add_argument("model")
    export.add_argument("folder")
    weights = commands.add_parser("random-weights")
    weights.add_argument("shape")
    weights.add_argument("out")
    args = parser.parse_args(argv)
    if args.command == "check-transformers":
        check_transformers()
    elif args.command == "export-shape":
        export_shape(args.model, args.folder)
    else:
        random_weights(args.shape, args.out)


if __name__ == "__main__":
    main()
