"""Full-ranking evaluation speed: torch chunked top-k, faiss IndexFlatIP, full ranks.

Each path is compared with the bound of its unavoidable work, the score
matrix product (U x N x d, 2 U N d FLOPs), timed alone as chunked GEMMs
with the same chunk size. Ratio 1.0 = as fast as the matmul itself; faiss
can beat it (its own BLAS blocking).

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

from bft_lightning.metrics.ranking import chunked_target_ranks, faiss_topk, torch_topk_chunked


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=20_000)
    p.add_argument("--items", type=int, default=20_000, help="real items (padding row added)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--chunk", type=int, default=2048, help="users per torch chunk")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def matmul_bound(users: torch.Tensor, items: torch.Tensor, chunk: int) -> float:
    """Seconds for all chunked score GEMMs (U x N x d), nothing else."""
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

    matmul_bound(users[: args.chunk], items[1:], args.chunk)  # warm-up (allocator, BLAS)
    bound = matmul_bound(users, items[1:], args.chunk)
    print(f"U={args.users} N={args.items} d={args.dim} k={args.k} threads={args.threads}")
    print(f"matmul bound        {bound:8.2f} s  ({flops / bound / 1e9:6.1f} GFLOP/s)")
    t_torch, (_, ids_t) = timed(lambda: torch_topk_chunked(users, items, args.k, args.chunk))
    t_faiss, (_, ids_f) = timed(lambda: faiss_topk(users, items, args.k))
    t_rank, _ = timed(lambda: chunked_target_ranks(users, items, target, args.chunk))
    for name, t in (("torch chunked top-k", t_torch), ("faiss IndexFlatIP", t_faiss)):
        print(f"{name:20s}{t:8.2f} s  ratio to bound {t / bound:5.2f}")
    print(f"{'full ranks (torch)':20s}{t_rank:8.2f} s  ratio to bound {t_rank / bound:5.2f}")
    same = (ids_t.sort(1).values == ids_f.sort(1).values).all(1).float().mean()
    print(f"top-k sets equal (torch vs faiss): {same.item():.4%} of users")


if __name__ == "__main__":
    main()
