"""Full-ranking evaluation speed: torch chunked top-k, faiss IndexFlatIP, full ranks.

Each path is compared with the bound of its unavoidable work, the score
matrix product (U x N x d, 2 U N d FLOPs), timed alone as GEMMs of cache-sized
tiles into one reused buffer (the fastest way found to compute it here; the
same GEMMs as whole user chunks into fresh outputs are timed too, for
comparison). Ratio 1.0 = as fast as the matmul itself. The bound is timed again
right before each path, whose ratio is to that run.

    OMP_WAIT_POLICY=PASSIVE python bench/eval_speed.py                 # small default
    OMP_WAIT_POLICY=PASSIVE python bench/eval_speed.py --users 100000 --items 100000 \\
        --dim 64 --k 10 --threads 2                                    # the paper-scale check

Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bft_lightning.metrics.ranking import (
    TILE_COLUMNS,
    TILE_USERS,
    chunked_target_ranks,
    faiss_topk,
    fast_bf16_matmul,
    tiled_target_ranks,
    torch_topk_chunked,
    torch_topk_tiled,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=20_000)
    p.add_argument("--items", type=int, default=20_000, help="real items (padding row added)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--k", type=int, default=10)
    p.add_argument(
        "--chunk", type=int, default=2048, help="users per chunk of the untiled torch paths"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def matmul_bound(
    users: torch.Tensor, items: torch.Tensor, tile_users: int, tile_columns: int
) -> float:
    """Seconds for all score GEMMs (U x N x d), nothing else, a cache-sized tile at a time
    into one reused buffer: the fastest way these cores compute the product."""
    items_t = items.T.contiguous()  # (d, N)
    n = items_t.shape[1]
    buf = torch.empty(tile_users, min(tile_columns, n))
    t0 = time.perf_counter()
    for u in users.split(tile_users):  # (c, d)
        for j in range(0, n, tile_columns):
            w = min(tile_columns, n - j)
            torch.mm(u, items_t[:, j : j + w], out=buf[: u.shape[0], :w])
    return time.perf_counter() - t0


def fresh_chunk_matmul(users: torch.Tensor, items: torch.Tensor, chunk: int) -> float:
    """Seconds for the same GEMMs as whole (chunk x N) products into fresh outputs."""
    items_t = items.T.contiguous()  # (d, N)
    t0 = time.perf_counter()
    for u in users.split(chunk):  # (c, d)
        torch.mm(u, items_t)  # (c, N), discarded
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import faiss

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    users = torch.randn(args.users, args.dim, generator=g)  # (U, d)
    items = torch.randn(args.items + 1, args.dim, generator=g)  # (N, d), row 0 = padding
    target = torch.randint(1, args.items + 1, (args.users,), generator=g)  # (U,)
    flops = 2.0 * args.users * args.items * args.dim

    tu, tc = TILE_USERS, TILE_COLUMNS
    matmul_bound(users[: 4 * tu], items[1:], tu, tc)  # warm-up (allocator, BLAS)
    print(f"U={args.users} N={args.items} d={args.dim} k={args.k} threads={args.threads}")
    print(f"bound: {tu}x{tc} tiles; each path is timed right after its own bound run, as")
    print("the machine's speed can drift between paths (other tenants, clocks)")
    print(f"bfloat16 screen of the tiled top-k: {'on' if fast_bf16_matmul() else 'off'} (this CPU)")
    paths: list[tuple[str, Callable[[], object]]] = [
        ("fresh chunk GEMMs", lambda: fresh_chunk_matmul(users, items[1:], args.chunk)),
        ("torch tiled top-k", lambda: torch_topk_tiled(users, items, args.k)[1]),
        (
            "  float32 tiles only",
            lambda: torch_topk_tiled(users, items, args.k, screen=False)[1],
        ),
        (
            "torch chunked top-k",
            lambda: torch_topk_chunked(users, items, args.k, args.chunk, tiled=False)[1],
        ),
        ("faiss IndexFlatIP", lambda: faiss_topk(users, items, args.k)[1]),
        ("tiled full ranks", lambda: tiled_target_ranks(users, items, target)),
        (
            "chunked full ranks",
            lambda: chunked_target_ranks(users, items, target, args.chunk, tiled=False),
        ),
    ]
    outs: dict[str, torch.Tensor] = {}
    for name, fn in paths:
        bound = matmul_bound(users, items[1:], tu, tc)
        t, out = timed(fn)
        if isinstance(out, torch.Tensor):
            outs[name] = out
        print(
            f"{name:20s}{t:8.2f} s  bound {bound:6.2f} s ({flops / bound / 1e9:5.1f} GFLOP/s)"
            f"  ratio to bound {t / bound:5.2f}"
        )
    ranks_t, ranks_c = outs["tiled full ranks"], outs["chunked full ranks"]
    ids_t, ids_c = outs["torch tiled top-k"], outs["torch chunked top-k"]
    ids_f = outs["faiss IndexFlatIP"]
    same_r = (ranks_t == ranks_c).float().mean()
    print(f"full ranks equal (tiled vs chunked): {same_r.item():.4%} of users")
    same_c = (ids_t.sort(1).values == ids_c.sort(1).values).all(1).float().mean()
    print(f"top-k sets equal (tiled vs chunked): {same_c.item():.4%} of users")
    ids_32 = outs["  float32 tiles only"]
    same_s = (ids_t.sort(1).values == ids_32.sort(1).values).all(1).float().mean()
    print(f"top-k sets equal (tiled, screened vs float32 tiles): {same_s.item():.4%} of users")
    same = (ids_t.sort(1).values == ids_f.sort(1).values).all(1).float().mean()
    print(f"top-k sets equal (torch vs faiss): {same.item():.4%} of users")


if __name__ == "__main__":
    main()
