#!/usr/bin/env bash
# Our decode loop on a GPU, in one short run: rollouts of srt/decode.py against Hugging Face
# `generate` at batch 1, K = 4 and K = 8 (as stage 2 runs them: ours on the bf16 copy of the policy,
# its decode step replayed as a CUDA graph; generate under bf16 autocast), whether the graph was
# replayed or fell back to eager decoding, and greedy equality of the two in fp32 (the embedded
# default's shape and tiny-random). Prints bench/rollout_speed.py's tables; writes under runs/gpu_rollouts/.
#
#   bash bench/gpu_rollouts.sh                                         # MODEL=smollm2-135m, installed
#   EXPORT_SHAPE=.gpu/smollm2-shape bash bench/gpu_rollouts.sh         # here: its config and tokenizer
#   SHAPE=.gpu/smollm2-shape bash bench/gpu_rollouts.sh                # there: that shape, random weights
#   CPU_SMOKE=1 MODEL=tiny-random TOKENS=8 REPEATS=1 CHECK_PROMPTS=4 bash bench/gpu_rollouts.sh   # on a CPU
#
# SHAPE is for a GPU machine the weights cannot reach (the embedded model is a 98 MB file): a folder
# with a model's config, generation config and tokenizer, to which the script gives random weights
# (seed 0). The time of a rollout depends on the shapes, not on the weights' values, and every row
# runs to exactly TOKENS new tokens on both sides (the stop tokens are suppressed), so the speed is
# that of the real model. The greedy check on random weights compares flatter logits than a
# trained model's: a difference there may be a near tie; tiny-random is checked too. PRECISION
# (auto, fp32, bf16; default auto, as stage 2) is the speed pass's --precision: the tests set fp32.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODEL=${MODEL:-smollm2-135m}
WORK=${WORK:-runs/gpu_rollouts}
DATA=${DATA:-runs/data}
PRECISION=${PRECISION:-auto}
TOKENS=${TOKENS:-128}
REPEATS=${REPEATS:-3}
CHECK_PROMPTS=${CHECK_PROMPTS:-32}

if [ -n "${EXPORT_SHAPE:-}" ]; then
    $PY bench/gpu_setup.py export-shape "$MODEL" "$EXPORT_SHAPE"
    exit 0
fi
if [ -n "${CPU_SMOKE:-}" ]; then
    export CUDA_VISIBLE_DEVICES=""
elif [ "$($PY -c 'import torch; print(torch.cuda.is_available())')" != "True" ]; then
    echo "error: no CUDA GPU visible: this check measures GPU rollouts (the CPU ones: bench/rollout_speed.py)" >&2
    exit 1
fi
mkdir -p "$WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
$PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
$PY bench/gpu_setup.py check-transformers  # an older one takes the cache under another name

if [ -n "${SHAPE:-}" ]; then
    $PY bench/gpu_setup.py random-weights "$SHAPE" "$WORK/model"
    MODEL="$WORK/model"
fi
[ -f "$DATA/train.jsonl" ] || $PY stage0_build.py --preset cpu-table2 --out "$DATA" --quiet

echo "== rollout speed: ours against generate, batch 1, K = 4, K = 8"
$PY bench/rollout_speed.py --model "$MODEL" --data "$DATA/train.jsonl" --ks 1,4,8 --repeats "$REPEATS" \
    --max-new-tokens "$TOKENS" --precision "$PRECISION" --out "$WORK/speed" || echo "FAILED: speed"
echo "== greedy equality, fp32: $MODEL"
$PY bench/rollout_speed.py --check --model "$MODEL" --data "$DATA/dev.jsonl" --max-new-tokens "$TOKENS" \
    --check-prompts "$CHECK_PROMPTS" --out "$WORK/check" | tail -1 || echo "FAILED: check"
echo "== greedy equality, fp32: tiny-random"
$PY bench/rollout_speed.py --check --model tiny-random --data "$DATA/dev.jsonl" --max-new-tokens "$TOKENS" \
    --check-prompts "$CHECK_PROMPTS" --out "$WORK/check-tiny" | tail -1 || echo "FAILED: check tiny-random"
