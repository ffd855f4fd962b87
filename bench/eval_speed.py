"""Full-ranking evaluation speed: the task's own validation path, and the top-k.

``task``: ``trainer.validate`` of a real ``SequentialRecommendation`` (SASRec,
d = 64, or ``--backbone``) over synthetic users' histories, timed whole (the encoder's forward is
part of the path and is also timed alone), against the bound of its
unavoidable work, the float32 score matrix product (U x N x d, 2 U N d FLOPs)
timed right before in the same process: user chunks of ``torch.mm`` against
all items into one reused output (once), and the same GEMMs as cache-sized tiles into
one reused buffer, the faster, timed again right before each path: the bound.

``topk``: ``bft_lightning.retrieval.topk`` throughput in users per second, with
and without the exclusion of each user's history, against the same bound and
faiss ``IndexFlatIP`` (exact inner product; no exclusion, bias, per-user factor
or log-sum-exp, so it could serve only the plain case).

    OMP_WAIT_POLICY=PASSIVE python bench/eval_speed.py task --users 100000 --items 100000
    OMP_WAIT_POLICY=PASSIVE python bench/eval_speed.py task --users 10000 --items 1000000
    OMP_WAIT_POLICY=PASSIVE python bench/eval_speed.py task --users 20000 --items 100000 \
        --paths encoder,encoder_full
    OMP_WAIT_POLICY=PASSIVE python bench/eval_speed.py topk --users 20000 --items 100000

Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from functools import partial

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from bft_lightning import retrieval
from bft_lightning.metrics.ranking import RankingMetric
from bft_lightning.models import HSTU, BERT4Rec, SASRec
from bft_lightning.tasks import SequentialRecommendation
from bft_lightning.tasks.recommendation import trim_left_padding

BACKBONES = {"sasrec": SASRec, "hstu": HSTU, "bert4rec": BERT4Rec}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("task", "topk"))
    p.add_argument("--users", type=int, default=10_000)
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--history", type=int, default=50, help="items per history (= max_len)")
    p.add_argument("--batch", type=int, default=512, help="evaluation batch size")
    p.add_argument("--mask", choices=("off", "on", "both"), default="both")
    p.add_argument(
        "--paths", default="task,encoder",
        help="task: trainer.validate; dense: the former dense path; encoder: its forward "
        "alone (the last layer at the predicting position only, as evaluation runs it); "
        "encoder_full: the forward with the last layer at every position (before)",
    )  # fmt: skip
    p.add_argument("--backbone", choices=("sasrec", "hstu", "bert4rec"), default="sasrec")
    p.add_argument("--k", type=int, default=10)
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="time each path (and its bound) this many times; the fastest is shown",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.no_grad()
def matmul_bound(
    users: Tensor, items: Tensor, chunk: int = 2048, tiles_only: bool = False
) -> tuple[float, float]:
    """Seconds of the U x N float32 product, nothing else: (user chunks of ``torch.mm``
    into one reused (chunk, N) output, 512 x 4096 tiles into one reused buffer). The
    tiles are the faster (the bound); ``tiles_only`` skips the chunks (NaN)."""
    items_t = items.T.contiguous()  # (d, N)
    n = items_t.shape[1]
    chunks = float("nan")
    if not tiles_only:
        out = torch.empty(min(chunk, users.shape[0]), n)
        t0 = time.perf_counter()
        for u in users.split(chunk):
            torch.mm(u, items_t, out=out[: u.shape[0]])
        chunks = time.perf_counter() - t0
    buf = torch.empty(512, min(4096, n))
    t0 = time.perf_counter()
    for u in users.split(512):
        for j in range(0, n, 4096):
            w = min(4096, n - j)
            torch.mm(u, items_t[:, j : j + w], out=buf[: u.shape[0], :w])
    return chunks, time.perf_counter() - t0


class Histories(Dataset):
    """Synthetic users: ``history`` random items each (no padding) and a random target."""

    def __init__(self, users: int, items: int, history: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, items + 1, (users, history), generator=g)
        self.target = torch.randint(1, items + 1, (users,), generator=g)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input_ids": self.ids[i], "target": self.target[i], "user": torch.tensor(i),
                "history_len": torch.tensor(self.ids.shape[1])}  # fmt: skip


@torch.no_grad()
def encoder_only(task: SequentialRecommendation, loader: DataLoader, last_only: bool) -> None:
    for batch in loader:
        ids = trim_left_padding(batch, keep_one=True)["input_ids"]
        task.model.last_hidden(ids, last_only=last_only)


@torch.no_grad()
def dense_path(task: SequentialRecommendation, loader: DataLoader, mask: bool) -> None:
    """The former evaluation: the batch's full score matrix and a dense history mask."""
    metric = RankingMetric(len(loader.dataset))  # type: ignore[arg-type]
    for batch in loader:
        batch = trim_left_padding(batch, keep_one=True)
        hidden, lp = task.model.last_hidden(batch["input_ids"])
        scores = task.model.score(hidden, lp).float()
        exclude = None
        if mask:
            exclude = torch.zeros_like(scores, dtype=torch.bool)
            exclude.scatter_(1, batch["input_ids"], True)
        metric.update(scores, batch["target"], batch["user"], exclude=exclude)
    metric.compute()


def run_task(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    backbone = partial(BACKBONES[args.backbone], d_model=args.dim)
    task = SequentialRecommendation(args.items, args.history, backbone=backbone).eval()
    loader = DataLoader(
        Histories(args.users, args.items, args.history, args.seed), batch_size=args.batch
    )
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    users = torch.randn(args.users, args.dim)
    items = task.model.item_weights()[1:].detach()
    matmul_bound(users[:2048], items)  # warm-up
    flops = 2.0 * args.users * args.items * args.dim
    print("| case | path | seconds | bound (s) | ratio to bound |")
    case = f"{args.users // 1000}k users x {args.items // 1000}k items"
    masks = {"off": [False], "on": [True], "both": [False, True]}[args.mask]
    paths = args.paths.split(",")
    rows: list[tuple[str, Callable[[], object]]] = []
    for mask in masks:
        name = f"mask_history={'on' if mask else 'off'}"

        def validate(mask: bool = mask) -> None:
            task.mask_history = mask
            trainer.validate(task, dataloaders=loader, verbose=False)

        if "task" in paths:
            rows.append((f"task validation, {name}", validate))
        if "dense" in paths:
            rows.append((f"former dense path, {name}", partial(dense_path, task, loader, mask)))
    if "encoder" in paths:
        rows.append(("encoder forward alone", partial(encoder_only, task, loader, True)))
    if "encoder_full" in paths:
        rows.append(("encoder forward, last layer at every position",
                     partial(encoder_only, task, loader, False)))  # fmt: skip
    chunks, _ = matmul_bound(users, items)
    print(f"(the same product as 2,048-user chunks into one reused output: {chunks:.2f} s)")
    for label, fn in rows:
        bound, t = float("inf"), float("inf")
        for _ in range(args.repeat):  # a shared host: the fastest of each
            bound = min(bound, matmul_bound(users, items, tiles_only=True)[1])
            t = min(t, timed(fn))
        print(
            f"| {case} | {label} | {t:.2f} | {bound:.2f} ({flops / bound / 1e9:.0f} GFLOP/s) "
            f"| {t / bound:.2f} |",
            flush=True,
        )


def run_topk(args: argparse.Namespace) -> None:
    import faiss  # only this comparison needs it

    faiss.omp_set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = SASRec(args.items, args.history, d_model=args.dim).eval()
    g = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(args.users, args.dim, generator=g)
    exclude = torch.randint(1, args.items + 1, (args.users, args.history), generator=g)
    items = model.item_weights()[1:].detach()
    matmul_bound(hidden[:2048], items)  # warm-up
    index = faiss.IndexFlatIP(args.dim)
    index.add(items.numpy())
    case = f"{args.users // 1000}k users x {args.items // 1000}k items, k={args.k}"
    print("| case | path | seconds | users/s | bound (s) | ratio to bound |")
    call = (model, hidden, None, args.k)
    for label, fn in (
        (f"retrieval.topk, {args.history} excluded", partial(retrieval.topk, *call, exclude)),
        ("retrieval.topk, none excluded", partial(retrieval.topk, *call)),
        ("faiss IndexFlatIP, none excluded", lambda: index.search(hidden.numpy(), args.k)),
    ):  # fmt: skip
        bound = matmul_bound(hidden, items, tiles_only=True)[1]
        t = timed(fn)
        print(
            f"| {case} | {label} | {t:.2f} | {args.users / t:,.0f} | {bound:.2f} | "
            f"{t / bound:.2f} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args}\nCPU: {platform.processor() or platform.machine()}, torch {torch.__version__}")
    run_task(args) if args.mode == "task" else run_topk(args)


if __name__ == "__main__":
    main()
