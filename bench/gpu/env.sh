# Shared set-up of the GPU scripts (bench/gpu/*.sh); sourced, not run.
#
# What it assumes of the GPU machine: Linux x86-64 with an NVIDIA driver, python3 >= 3.10
# with venv, and pip able to reach PyPI (the default torch wheel there is a CUDA build,
# Triton included). It sets up, in the repository root of the machine's copy of the tree:
#
#   $PY        the Python every stage runs (a fresh .gpu_venv; or $BFT_GPU_PYTHON)
#   $OUT       where the results go (the device machine sets it; default .gpu_out)
#   $LOG       $OUT/<script>.log, everything the stages print
#   stage S N CMD...   run CMD under `timeout N`, its output appended to $LOG; a stage
#                      that fails or runs out of time is logged and the script goes on
#
# Environment:
#   BFT_GPU_TINY=1          a CPU check at tiny sizes (seconds): no install, device cpu
#   BFT_GPU_SKIP_INSTALL=1  use $BFT_GPU_PYTHON (or .gpu_venv, e.g. a carried one) as is
#   BFT_GPU_PYTHON          the interpreter to use (default: .gpu_venv/bin/python)
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
# the one install line: torch at the version the project pins, from PyPI (a CUDA build)
INSTALL=(-m pip install -q "torch==2.13.0" -e ".[tune,lm,triton]")

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
  PY="${BFT_GPU_PYTHON:-$REPO/.gpu_venv/bin/python}"
  DEVICE=cuda
  ACCELERATOR=gpu
  if [ "${BFT_GPU_SKIP_INSTALL:-0}" != "1" ]; then
    if [ ! -x "$PY" ]; then
      stage venv 60 python3 -m venv "$REPO/.gpu_venv"
    fi
    stage install 240 "$PY" "${INSTALL[@]}"
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
