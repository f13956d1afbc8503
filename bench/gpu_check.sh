#!/usr/bin/env bash
# The first check on a GPU machine, in one command (docs/gpu.md says what to bring to one without a
# package registry). Three parts (PARTS, default all three):
#   rollouts  bench/gpu_rollouts.sh: our decode loop against Hugging Face generate, greedy equality
#   train     a few SFT steps, then GRPO from that SFT's final/, with and without --fsdp ("plain": one
#             process, or DDP over 2+ GPUs), in bf16 compute over fp32 master weights; per run: steps
#             and tokens per second (the first step, a warm-up, not counted), the peak GPU memory of
#             rank 0 beside the memory planner's (memory_plan.py, printed by each stage at its start),
#             and GRPO's rollout seconds with --fsdp against without
#   tests     the test suite
#
#   bash bench/gpu_check.sh                                          # the embedded default, data built here
#   EXPORT_SHAPE=.gpu/smollm2-shape bash bench/gpu_check.sh          # here: the default's shape, no weights
#   DATA=.gpu/data SHAPE=.gpu/smollm2-shape bash bench/gpu_check.sh  # there: that shape, random weights
#   NGPU=1 STEPS=4 PARTS=train bash bench/gpu_check.sh               # one GPU (FSDP over one process runs too)
#   CPU_SMOKE=1 NGPU=2 DATA=runs/data MODEL=tiny-random STEPS=2 bash bench/gpu_check.sh   # on CPUs
#
# PARTS chooses parts, MODES the training runs (plain, fsdp), TESTS the test files (default all);
# K, PROMPTS, NEW_TOKENS, PROMPT_TOKENS, MICRO_BATCH and SFT_LENGTH size the runs (default: the
# configuration docs/gpu.md reports); DTYPE is both stages' --dtype (default auto: bf16 compute on a
# GPU; the tests' CPU smoke sets float32).
#
# DATA: a folder of stage-0 output (train.jsonl, dev.jsonl); without it stage 0 builds one under WORK,
# which needs the chitchat-dataset package and the sentence embedder. MODEL: a model name or folder.
# SHAPE: a folder with a model's config, generation config and tokenizer (EXPORT_SHAPE writes one),
# given random weights here: speed and memory depend on the shapes, not on the values. GRPO scores
# with --answer-reward keys (ANSWER_REWARD), which needs no embedder. Each part of each run has its
# own timeout (TIMEOUT_ROLLOUTS, TIMEOUT_RUN, TIMEOUT_TESTS, seconds) and its own log under
# WORK/logs; its lines print as they come, with the seconds since it began, progress bars left out.
# A part that fails or runs out of time says so, and the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
PARTS=${PARTS:-rollouts train tests}
MODES=${MODES:-plain fsdp}
TESTS=${TESTS:-tests}
STEPS=${STEPS:-6}
MODEL=${MODEL:-smollm2-135m}
WORK=${WORK:-runs/gpu_check}
DATA=${DATA:-$WORK/data}
DIALOGUES=${DIALOGUES:-200}
K=${K:-8}
PROMPTS=${PROMPTS:-2}
NEW_TOKENS=${NEW_TOKENS:-256}
PROMPT_TOKENS=${PROMPT_TOKENS:-1024}
SFT_LENGTH=${SFT_LENGTH:-1024}
MICRO_BATCH=${MICRO_BATCH:-4}
ANSWER_REWARD=${ANSWER_REWARD:-keys}
TIMEOUT_ROLLOUTS=${TIMEOUT_ROLLOUTS:-900}
TIMEOUT_RUN=${TIMEOUT_RUN:-600}
TIMEOUT_TESTS=${TIMEOUT_TESTS:-1800}
DTYPE=${DTYPE:-auto}

if [ -n "${EXPORT_SHAPE:-}" ]; then
    exec $PY bench/gpu_setup.py export-shape "$MODEL" "$EXPORT_SHAPE"
fi
if [ -n "${CPU_SMOKE:-}" ]; then
    export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
fi
NGPU=${NGPU:-$($PY -c 'import torch; print(torch.cuda.device_count())')}
if [ -z "${CPU_SMOKE:-}" ] && [ "$NGPU" -lt 1 ]; then
    echo "error: no CUDA GPU visible: this check measures GPU runs (the CPU tests are \`make test\`)" >&2
    exit 1
fi
mkdir -p "$WORK/logs"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
$PY -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
$PY bench/gpu_setup.py check-transformers || exit 1

# One part: its own timeout and log, its lines as they come (tqdm's carriage returns made lines and
# dropped; a pipe through a plain filter would hold them until the part ends, or lose them to the
# timeout). The part's exit status, not the filter's, decides what is reported.
part() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name (at most ${limit}s; log $WORK/logs/$name.log)"
    timeout --kill-after=30 "$limit" "$@" 2>&1 | stdbuf -oL tr '\r' '\n' | grep --line-buffered -vE '^$|it/s|s/it' \
        | while IFS= read -r line; do printf '%5ds  %s\n' $((SECONDS - start)) "$line"; done \
        | tee "$WORK/logs/$name.log"
    local status=${PIPESTATUS[0]}
    case $status in
        0) echo "== $name: done in $((SECONDS - start))s" ;;
        124 | 137) echo "== $name: TIMED OUT after $((SECONDS - start))s" ;;
        *) echo "== $name: FAILED (exit $status) after $((SECONDS - start))s" ;;
    esac
}

if [ -n "${SHAPE:-}" ]; then
    part model 300 $PY bench/gpu_setup.py random-weights "$SHAPE" "$WORK/model"
    MODEL="$WORK/model"
fi
if [ ! -f "$DATA/train.jsonl" ]; then
    if [ "$DATA" != "$WORK/data" ]; then
        echo "error: DATA=$DATA has no train.jsonl (stage 0's output)" >&2
        exit 1
    fi
    part stage0 900 $PY stage0_build.py --source synthetic --num-dialogues "$DIALOGUES" --out "$DATA" --quiet
fi

for name in $PARTS; do
    case $name in
    rollouts)
        part rollouts "$TIMEOUT_ROLLOUTS" env MODEL="$MODEL" DATA="$DATA" WORK="$WORK/rollouts" SHAPE= \
            bash bench/gpu_rollouts.sh
        ;;
    train)
        RUN="$PY -m torch.distributed.run --standalone --nproc_per_node=$NGPU"
        for mode in $MODES; do
            flag=$([ $mode = fsdp ] && echo --fsdp || true)
            rm -rf "$WORK/sft_$mode" "$WORK/grpo_$mode" # a failed run must not show an older one's metrics
            part "sft_$mode" "$TIMEOUT_RUN" $RUN stage1_sft.py --model "$MODEL" --data "$DATA/train.jsonl" \
                --phase 2 --max-steps "$STEPS" --batch-size 4 --max-length "$SFT_LENGTH" --gradient-checkpointing \
                --save-every 1000 --warmup-steps 1 --dtype "$DTYPE" $flag --out "$WORK/sft_$mode"
            part "grpo_$mode" "$TIMEOUT_RUN" $RUN stage2_grpo.py --model "$WORK/sft_$mode/final" \
                --data "$DATA/train.jsonl" --max-steps "$STEPS" -K "$K" --prompts-per-step "$PROMPTS" \
                --max-new-tokens "$NEW_TOKENS" --max-prompt-length "$PROMPT_TOKENS" --sample-ratio 2 \
                --micro-batch-size "$MICRO_BATCH" --gradient-checkpointing --answer-reward "$ANSWER_REWARD" \
                --eval-limit 0 --save-every 0 --warmup-steps 1 --dtype "$DTYPE" $flag --out "$WORK/grpo_$mode"
        done
        ;;
    tests)
        part tests "$TIMEOUT_TESTS" $PY -m pytest -q -p no:cacheprovider $TESTS
        ;;
    *)
        echo "error: unknown part $name in PARTS (rollouts, train, tests)" >&2
        ;;
    esac
done

echo "== summary"
$PY bench/gpu_summary.py "$WORK" "$NGPU"
