"""Peak memory of one kriging attention call (forward + backward) against the off twin's SDPA.

Each (shape, path) runs in a fresh process: after one warm-up call, the peak
resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) is read over
one forward and backward, minus the resident set before it (the inputs, the
mask and the loss weights are already allocated). CPU only (Linux), float32.
``MALLOC_MMAP_THRESHOLD_`` is fixed so that freed blocks go back to the system
in every process alike.

Paths:

- ``off``: the off twin's attention, ``attention.sdpa_attention`` (PyTorch's
  fused kernel; the (B, 1, T, S) mask as the layers build it);
- ``blockwise``: ``kernels.blockwise.blockwise_attention`` with that same mask;
- ``blockwise-kv``: the same without any (T x S) mask: ``key_valid`` and ``is_causal``;
- ``chunked``: ``nn.chunked.chunked_attention`` (query blocks of 256), for context.

The loss reads every output the filter reads (estimate, second moment,
``sum p^2``, the output), with fixed random weights.

    python bench/kernel_memory.py --out results/perf/kernels.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = ((64, 200), (8, 1024), (2, 4096))  # (B, T); H = 2, d_h = 32
PATHS = ("off", "blockwise", "blockwise-kv", "chunked")


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"{field}:\s+(\d+)", text)
    assert match is not None, field
    return int(match.group(1)) * 1024


def _worker(path: str, b: int, t: int, h: int, dh: int, dropout: float, block: int) -> dict:
    import torch

    sys.path.insert(0, str(REPO))
    from bft_lightning.nn.attention import build_allowed, sdpa_attention
    from bft_lightning.nn.chunked import chunked_attention
    from bft_lightning.nn.kernels.blockwise import blockwise_attention

    torch.manual_seed(0)
    torch.set_num_threads(1)
    q, k, v = (torch.randn(b, h, t, dh, requires_grad=True) for _ in range(3))
    bias = torch.randn(b, h, t, requires_grad=True)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[: b // 2, : t // 4] = False  # left padding in half the sequences
    allowed = build_allowed(valid, is_causal=True)
    if path in ("off", "chunked", "blockwise"):
        allowed = allowed.contiguous()  # as the layers hold it
    weights = [torch.randn(b, h, t, dh), torch.randn(b, h, t, dh), torch.randn(b, h, t)]
    weights.append(torch.randn(b, h, t))

    def step() -> None:
        if path == "off":
            out = sdpa_attention(q, k, v, allowed, dropout)
            loss = (out * weights[0]).sum()
            grads = torch.autograd.grad(loss, (q, k, v))
        else:
            if path == "chunked":
                outs = chunked_attention(q, k, v, allowed, bias, dropout, 256)
            elif path == "blockwise":
                outs = blockwise_attention(q, k, v, allowed, bias, dropout, block or None)
            else:
                outs = blockwise_attention(
                    q, k, v, None, bias, dropout, block or None, key_valid=valid, is_causal=True
                )
            loss = sum((o * w).sum() for o, w in zip(outs, weights, strict=True))
            grads = torch.autograd.grad(loss, (q, k, v, bias))
        del grads

    step()  # warm-up: thread pools, lazy initialisation
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current RSS
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    return {"peak_mb": (peak - base) / 2**20, "seconds": seconds}


def _run(path: str, b: int, t: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [
        sys.executable, __file__, "--worker", path, "--b", str(b), "--t", str(t),
        "--heads", str(args.heads), "--head-dim", str(args.head_dim),
        "--dropout", str(args.dropout), "--block", str(args.block),
    ]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--b", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--t", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--block", type=int, default=0, help="blockwise key block (0: default)")
    parser.add_argument("--shapes", nargs="*", default=[f"{b},{t}" for b, t in SHAPES],
                        help="B,T pairs")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="append the table here")
    args = parser.parse_args()
    if args.worker:
        res = _worker(args.worker, args.b, args.t, args.heads, args.head_dim, args.dropout,
                      args.block)  # fmt: skip
        print(json.dumps(res))
        return
    lines = [
        f"H = {args.heads}, d_h = {args.head_dim}, causal, left padding in half the rows, "
        f"dropout {args.dropout}, blockwise key block {args.block or 'default (2 d_h)'}; "
        "peak RSS above the inputs over one forward + backward (MB), its ratio to the off "
        "twin's, and that call's time (s, one run, 1 thread)",
        "",
        "| B, T | " + " | ".join(f"{p} MB" for p in PATHS) + " | "
        + " | ".join(f"{p} / off" for p in PATHS[1:]) + " | "
        + " | ".join(f"{p} s" for p in PATHS) + " |",
        "|---" * (3 * len(PATHS)) + "|",
    ]  # fmt: skip
    for shape in args.shapes:
        b, t = (int(x) for x in shape.split(","))
        res = {p: _run(p, b, t, args) for p in PATHS}
        mb = [res[p]["peak_mb"] for p in PATHS]
        ratios = [m / mb[0] for m in mb[1:]]
        row = f"| {b}, {t} | " + " | ".join(f"{m:.1f}" for m in mb) + " | "
        row += " | ".join(f"{r:.2f}" for r in ratios) + " | "
        row += " | ".join(f"{res[p]['seconds']:.3f}" for p in PATHS) + " |"
        lines.append(row)
        print(row, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
