# Shared set-up of the GPU scripts (bench/gpu/*.sh); sourced, not run.
#
# What it assumes of the GPU machine: Linux x86-64, one NVIDIA GPU, no network, and the
# device image's `python3` (Python 3.12 with PyTorch, Triton, Lightning, torchmetrics,
# TensorBoard, matplotlib, pyarrow, tokenizers, safetensors). The packages the project
# needs beyond those (jsonargparse and Optuna, with their own needs) travel as wheels in
# .gpu_carry/wheels, fetched here by `python bench/gpu/stage_data.py --wheels`; they are
# installed into /tmp/site, and the package itself runs from the tree (PYTHONPATH), not
# installed. It sets up:
#
#   $PY        the Python every stage runs
#   $OUT       where the results go (the device machine sets it; default .gpu_out)
#   $LOG       $OUT/<script>.log, everything the stages print
#   stage S N CMD...   run CMD under `timeout N`, its output appended to $LOG; a stage
#                      that fails or runs out of time is logged and the script goes on
#
# Environment:
#   BFT_GPU_TINY=1          a CPU check at tiny sizes: this checkout's .venv, device cpu
#   BFT_GPU_PYTHON          the interpreter (default: python3; tiny: .venv/bin/python)
#   BFT_GPU_INSTALL=pypi    a machine with network: a fresh .gpu_venv, the project and a
#                           CUDA torch from PyPI (the one install line, INSTALL below)
#   BFT_GPU_JOBS            concurrent jobs where a script runs several (default: 12)

set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO" || exit 1
SCRIPT_NAME="$(basename "$0" .sh)"
OUT="${OUT:-$REPO/.gpu_out}"
mkdir -p "$OUT"
LOG="$OUT/$SCRIPT_NAME.log"
: >"$LOG"
TINY="${BFT_GPU_TINY:-0}"
JOBS="${BFT_GPU_JOBS:-12}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" OMP_WAIT_POLICY=PASSIVE
export BFT_DATA_ROOT="$REPO/.gpu_carry/data"  # staged by bench/gpu/stage_data.py
T_START=$(date +%s)
# the one install line, for a machine with network (BFT_GPU_INSTALL=pypi): torch at the
# version the project pins, from PyPI (a CUDA build), and the project with its extras
INSTALL=(-m pip install -q "torch==2.13.0" -e ".[tune,lm,triton]")
WHEELS="$REPO/.gpu_carry/wheels"

log() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - T_START))s] $*" | tee -a "$LOG"; }

stage() {  # stage NAME SECONDS CMD...: one bounded step, logged; its status returned
  local name="$1" limit="$2"
  shift 2
  log "stage $name (at most ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    log "stage $name ran out of its ${limit}s"
  elif [ "$rc" -ne 0 ]; then
    log "stage $name failed (exit status $rc)"
  else
    log "stage $name done"
  fi
  return "$rc"
}

left() {  # seconds left of a budget of $1 seconds since the script started
  echo $(($1 - ($(date +%s) - T_START)))
}

if [ "$TINY" = "1" ]; then
  PY="${BFT_GPU_PYTHON:-$REPO/.venv/bin/python}"
  DEVICE=cpu
  ACCELERATOR=cpu
else
  DEVICE=cuda
  ACCELERATOR=gpu
  if [ "${BFT_GPU_INSTALL:-image}" = "pypi" ]; then
    PY="${BFT_GPU_PYTHON:-$REPO/.gpu_venv/bin/python}"
    [ -x "$PY" ] || stage venv 60 python3 -m venv "$REPO/.gpu_venv"
    stage install 240 "$PY" "${INSTALL[@]}"
  else
    PY="${BFT_GPU_PYTHON:-python3}"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
      stage wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
      export PYTHONPATH="/tmp/site:$PYTHONPATH"
    else
      log "no wheels in $WHEELS: the image's packages only (stage them: stage_data.py --wheels)"
    fi
  fi
fi

{
  echo "== $SCRIPT_NAME, $(date -u '+%Y-%m-%d %H:%M UTC'), tiny=$TINY"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  "$PY" - <<'PYEOF' 2>&1 || true
import sys, torch
try:
    import triton; tri = triton.__version__
except ImportError:
    tri = "absent"
import lightning
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"GPU: {gpu}; python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}, triton {tri}, lightning {lightning.__version__}")
PYEOF
} | tee -a "$LOG" | tee "$OUT/versions.txt"
