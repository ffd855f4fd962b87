#!/usr/bin/env bash
# The synthetic-QA noisy-SFT study at 5-30M parameters on one GPU, unattended, within
# one device command (default budget 540 s of the 600 s limit).
#
# 1. pre-trains the shared base (bench/lm_synthetic.py --stage pretrain; model d384,
#    10.8M parameters) on the task's passages;
# 2. runs the SFT grid from it: off, bft, focal, label_smoothing x label noise 0, 0.3 x
#    distractors 0, 4 x seeds 0, 1, 2 (48 runs), in BFT_GPU_JOBS shards at once on the
#    one GPU (1 CPU thread each); the off twin, the baseline, is trained in the same call
#    from the same base; no run starts in the last ~2.5 minutes of the budget;
# 3. writes the report (results/lm/gpu/summary.json: summary.json's rows, with the
#    model and its parameter count, `params`, on each row).
# Runs already in results/lm/gpu/synthetic_runs are skipped (a second call completes a
# grid cut short; it pre-trains the base again with the same recipe and seed).
# Writes $OUT/lm_study.tar.gz (the runs, the report, the pretraining record) and
# $OUT/lm_study.log.
#
# Environment (besides bench/gpu/env.sh's): BFT_GPU_BUDGET_S (540), BFT_LM_MODEL (d384),
# BFT_LM_PRETRAIN_STEPS (3000), BFT_LM_SFT_STEPS (400), BFT_LM_LR (1e-3, SFT),
# BFT_LM_PRETRAIN_LR (1e-3), BFT_LM_SEEDS ("0 1 2"), BFT_LM_METHODS, BFT_LM_NOISE,
# BFT_LM_DISTRACTORS, BFT_LM_OUT (results/lm/gpu).
# Unpack what comes back here: python bench/gpu/unpack.py <files_at>

source "$(dirname "$0")/env.sh"
BUDGET="${BFT_GPU_BUDGET_S:-540}"
MODEL="${BFT_LM_MODEL:-d384}"
WORK="$(mktemp -d)"
LM_OUT="$REPO/results/lm/gpu"
[ "$TINY" = "1" ] && LM_OUT="$WORK/gpu"  # a CPU check leaves the tree's results alone
LM_OUT="${BFT_LM_OUT:-$LM_OUT}"
read -r -a SEEDS <<<"${BFT_LM_SEEDS:-0 1 2}"
read -r -a METHODS <<<"${BFT_LM_METHODS:-off bft focal label_smoothing}"
read -r -a NOISE <<<"${BFT_LM_NOISE:-0 0.3}"
read -r -a DISTRACTORS <<<"${BFT_LM_DISTRACTORS:-0 4}"
# the data of the CPU study (results/lm/FINDINGS.md), so that the two sizes compare
DATA=(--facts 2 --value-words 1)
COMMON=(--work "$WORK" --out "$LM_OUT" --model "$MODEL" --accelerator "$ACCELERATOR" "${DATA[@]}")
mkdir -p "$LM_OUT"

stage pretrain $(($(left "$BUDGET") - 240)) "$PY" bench/lm_synthetic.py "${COMMON[@]}" --stage pretrain \
  --pretrain-steps "${BFT_LM_PRETRAIN_STEPS:-3000}" --pretrain-lr "${BFT_LM_PRETRAIN_LR:-1e-3}" \
  --pretrain-recall 8 --pretrain-seq-len 96

if [ -f "$WORK/pretrain-$MODEL.json" ]; then
  # no run starts after STOP (UTC date and minute): ~150 s before the budget ends
  STOP=$(date -u -d "@$(($(date +%s) + $(left "$BUDGET") - 150))" +%Y-%m-%dT%H:%M)
  SFT=(--stage sft --sft-steps "${BFT_LM_SFT_STEPS:-400}" --lr "${BFT_LM_LR:-1e-3}"
    --methods "${METHODS[@]}" --noise "${NOISE[@]}" --distractors "${DISTRACTORS[@]}"
    --seeds "${SEEDS[@]}" --threads 1 --stop-at "$STOP")
  LIMIT=$(($(left "$BUDGET") - 120))
  for i in $(seq 0 $((JOBS - 1))); do
    stage "sft-$i/$JOBS" "$LIMIT" "$PY" bench/lm_synthetic.py "${COMMON[@]}" "${SFT[@]}" --shard "$i/$JOBS" &
  done
  wait
  stage report 90 "$PY" bench/lm_synthetic.py "${COMMON[@]}" --stage report
  cp "$WORK/pretrain-$MODEL.json" "$LM_OUT/pretrain-$MODEL.json"
else
  log "no pretrained base: the SFT grid was not run"
fi

printf '{"kind": "lm_study", "command": "bash bench/gpu/lm_study.sh", "model": "%s", "tiny": %s}\n' \
  "$MODEL" "$([ "$TINY" = "1" ] && echo true || echo false)" >"$LM_OUT/manifest.json"
cp "$OUT/versions.txt" "$LM_OUT/versions.txt"
tar -czf "$OUT/lm_study.tar.gz" -C "$(dirname "$LM_OUT")" --transform "s|^$(basename "$LM_OUT")|lm_study|" "$(basename "$LM_OUT")"
log "packed $(ls "$LM_OUT/synthetic_runs" 2>/dev/null | wc -l) runs into $OUT/lm_study.tar.gz"
