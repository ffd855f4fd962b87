#!/usr/bin/env bash
# The strong-baselines campaign's next pending steps on one GPU, unattended, within one
# device command (default budget 540 s of the 600 s limit).
#
# Reads bench/gpu/campaign.txt (bench/gpu/campaign.py says which step is next) and runs
# each pending step through bench/tune_twins.py (--accelerator gpu, --loss-normalization
# rows): the two twins' studies at once (--study-only off / on, BFT_GPU_JOBS workers
# between them), then the retrainings, several tune_twins processes at once (each run
# folder is locked by the process training it), then the paired report. Every phase is
# bounded with `timeout`; studies and runs resume, so a step cut short continues in the
# next call from the study databases that came back. Then it packs the files the call
# wrote into $OUT/campaign.tar.gz (+ campaign.log, versions.txt).
#
# Needs the datasets in .gpu_carry/data (python bench/gpu/stage_data.py --campaign, here,
# before the call; carry .gpu_carry). The baseline (the off twin) is tuned and retrained
# in the same call as BFT, as every step of tune_twins does.
#
# Environment (besides bench/gpu/env.sh's): BFT_GPU_BUDGET_S (540), BFT_CAMPAIGN_TRIALS
# (10), BFT_CAMPAIGN_SEEDS ("0 1 2"), BFT_CAMPAIGN_MAX_EPOCHS (100), BFT_CAMPAIGN_RETRAIN
# (parallel retraining processes, 6), BFT_CAMPAIGN_OVERRIDES (extra tune_twins options),
# BFT_GPU_CAMPAIGN (the campaign file).
# Unpack what comes back here: python bench/gpu/unpack.py <files_at>

source "$(dirname "$0")/env.sh"
BUDGET="${BFT_GPU_BUDGET_S:-540}"
TRIALS="${BFT_CAMPAIGN_TRIALS:-10}"
read -r -a SEEDS <<<"${BFT_CAMPAIGN_SEEDS:-0 1 2}"
EPOCHS="${BFT_CAMPAIGN_MAX_EPOCHS:-100}"
RETRAIN="${BFT_CAMPAIGN_RETRAIN:-6}"
read -r -a EXTRA <<<"${BFT_CAMPAIGN_OVERRIDES:-}"
RESULTS_DIR="$REPO/results/rec"
RUNS_DIR="$REPO/logs/tune_twins"
if [ "$TINY" = "1" ]; then  # a CPU check leaves the tree's results alone
  TMP_ROOT="$(mktemp -d)"
  RESULTS_DIR="$TMP_ROOT/rec"
  RUNS_DIR="$TMP_ROOT/runs"
fi
WHERE=(--results "$RESULTS_DIR" --runs "$RUNS_DIR")
MARKER="$(mktemp)"
touch "$MARKER"
sleep 1  # the marker strictly older than anything the run writes
HALF=$(((JOBS + 1) / 2))
COMMON=(--trials "$TRIALS" --seeds "${SEEDS[@]}" --max-epochs "$EPOCHS" --accelerator "$ACCELERATOR"
  --loss-normalization rows --data-root "$BFT_DATA_ROOT" --results-dir "$RESULTS_DIR"
  --runs-dir "$RUNS_DIR" "${EXTRA[@]}")
DONE_STEPS=()

while :; do
  STEP=$("$PY" bench/gpu/campaign.py next "${WHERE[@]}" --seeds "${SEEDS[@]}" 2>>"$LOG")
  if [ -z "$STEP" ]; then
    log "no pending step: the campaign is complete"
    break
  fi
  read -r DATASET BACKBONE NOISE SPACE NAME <<<"$STEP"
  if [ "$(left "$BUDGET")" -lt 150 ]; then
    log "next step $NAME left for the next call ($(left "$BUDGET")s left)"
    break
  fi
  log "step $NAME: $TRIALS trials a twin, seeds ${SEEDS[*]}, $JOBS jobs"
  ARGS=(--dataset "$DATASET" --backbone "$BACKBONE" --space "$SPACE" --noise "$NOISE" "${COMMON[@]}")
  # 1. both twins' studies at once
  LIMIT=$(($(left "$BUDGET") - 60))
  stage "studies-off" "$LIMIT" "$PY" bench/tune_twins.py "${ARGS[@]}" --jobs "$HALF" --study-only off &
  stage "studies-on" "$LIMIT" "$PY" bench/tune_twins.py "${ARGS[@]}" --jobs "$HALF" --study-only on &
  wait
  # 2. retrainings: processes share the runs through their locks; 3. the report (a
  # process that finds every run finished writes the complete table)
  LIMIT=$(($(left "$BUDGET") - 40))
  if [ "$LIMIT" -gt 30 ]; then
    for i in $(seq 1 "$RETRAIN"); do
      stage "retrain-$i" "$LIMIT" "$PY" bench/tune_twins.py "${ARGS[@]}" --jobs 1 &
      sleep 2  # each takes the next free run
    done
    wait
  fi
  if "$PY" bench/gpu/campaign.py next "${WHERE[@]}" --seeds "${SEEDS[@]}" 2>>"$LOG" | grep -q "^$DATASET $BACKBONE $NOISE $SPACE "; then
    log "step $NAME not finished in this call: it continues in the next"
    break
  fi
  DONE_STEPS+=("$NAME")
done

MANIFEST=$(printf '{"kind": "campaign", "finished": "%s", "trials": %s, "seeds": "%s", "tiny": %s, "versions": "%s", "command": "bash bench/gpu/campaign.sh"}' \
  "${DONE_STEPS[*]:-}" "$TRIALS" "${SEEDS[*]}" "$([ "$TINY" = "1" ] && echo true || echo false)" \
  "$(tail -n 1 "$OUT/versions.txt" | tr -d '"\\')")
stage pack 60 "$PY" bench/gpu/campaign.py pack "${WHERE[@]}" --since "$MARKER" --archive "$OUT/campaign.tar.gz" --manifest "$MANIFEST"
"$PY" bench/gpu/campaign.py status "${WHERE[@]}" --seeds "${SEEDS[@]}" 2>&1 | tee -a "$LOG"
rm -f "$MARKER"
log "finished: steps completed in this call: ${DONE_STEPS[*]:-none}"
