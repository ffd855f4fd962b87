#!/usr/bin/env bash
# The CUDA fast-path table (bench/cuda_fast_path.py) on one GPU, unattended, within one
# device command (default budget 540 s of the 600 s limit).
#
# Two bounded stages, each also writing its tables line by line (a stage cut short
# keeps what it measured): eager (the fused kernel's agreement with the reference on
# this GPU, one layer off against on for the chunked, blockwise and fused kernels at
# T = 50, 200, 1024, a SASRec / BERT4Rec / HSTU training step with peak memory), then
# compiled (the same under torch.compile, and the kernel-count table). Every ratio is
# against the off twin measured in the same call. Writes $OUT/fast_path.tar.gz (tables
# as markdown and JSON, the versions) and $OUT/fast_path.log.
#
# Environment: see bench/gpu/env.sh (BFT_GPU_TINY=1: a CPU check at tiny sizes).
# Unpack what comes back here: python bench/gpu/unpack.py <files_at>

source "$(dirname "$0")/env.sh"
BUDGET="${BFT_GPU_BUDGET_S:-540}"
WORK="$(mktemp -d)/fast_path"
mkdir -p "$WORK"
cp "$OUT/versions.txt" "$WORK/"
FLAGS=()
[ "$TINY" = "1" ] && FLAGS=(--tiny)
stage eager $(($(left "$BUDGET") / 2)) "$PY" bench/cuda_fast_path.py --device "$DEVICE" "${FLAGS[@]}" \
  --modes eager --skip-kernel-count --md "$WORK/eager.md" --json "$WORK/eager.json"
if [ "$TINY" = "1" ]; then  # compiling on a CPU takes minutes: the check stops at eager
  log "stage compiled skipped (tiny)"
else
  stage compiled $(($(left "$BUDGET") - 30)) "$PY" bench/cuda_fast_path.py --device "$DEVICE" \
    --modes compiled --skip-correctness --md "$WORK/compiled.md" --json "$WORK/compiled.json"
fi
printf '{"kind": "fast_path", "command": "bash bench/gpu/fast_path.sh", "tiny": %s}\n' \
  "$([ "$TINY" = "1" ] && echo true || echo false)" >"$WORK/manifest.json"
tar -czf "$OUT/fast_path.tar.gz" -C "$(dirname "$WORK")" fast_path
log "packed $(ls "$WORK" | tr '\n' ' ')into $OUT/fast_path.tar.gz"
