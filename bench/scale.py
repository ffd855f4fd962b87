"""Scale benchmark: readers, k-core, split, training and evaluation on power-law logs.

Synthetic logs: users with geometric history lengths (mean 10), items drawn
from a Zipf law (exponent 1.1) over ``--items``, times increasing per user and
the file in global time order (users interleaved, as a real log). Each case is
written as an Amazon-like headerless CSV (``item,user,rating,timestamp``,
ASIN-shaped items, 14-character users) under ``--workdir`` (default /tmp).

Per case, each step in a fresh process (so peak RSS, ``VmHWM``, is the step's own):

- ``read``: ``read_interactions(kcore=0)``; ``pandas``: ``pd.read_csv`` of the
  same columns + ``factorize`` + the stable per-user sort that gives the same
  sequences (checked equal); ``kcore``: ``kcore_filter(log, 5)``; ``split``:
  ``encode`` + ``leave_one_out`` + the train / valid / test arrays;
  peak RSS of the read against the bytes of the final arrays;
- ``cache``: building the memory-mapped cache, opening and mapping it;
- ``train:<loss>`` for each loss of ``--losses``: seconds per million training
  targets of ``trainer.fit`` over the first ``--train-batches`` batches (timed
  after one warm-up batch; SASRec d=32, max_len 50, 32 rows a batch), on the
  whole log (no k-core: the model scores every item of the file);
  ``ce`` is run only where its logits fit ``--ce-limit-gb`` (logits, their
  softmax and their gradient: 3 x targets x (items + 1) x 4 bytes);
- ``optim``: the task's AdamW step alone over the case's model (per batch, O(items));
- ``eval``: ``trainer.validate`` of the task (its own validation loop, full
  ranking) over the first ``--eval-users`` evaluated users (0: all), against
  its bound, the float32 score product (the same users x (items + 1) x d) in
  512 x 4096 tiles into one reused buffer (the full product per batch, whose
  fresh output page faults, is recorded too as ``dense_product_s``).

The large case (1e7 interactions, 1e6 items) times 3 training batches per loss
and evaluates 4,096 users by default, so that it runs in minutes on 2 cores.

Results are merged into ``--json`` (one entry per case and step, with the host's
load average before the step); ``report`` writes the markdown table from it,
with the least-squares log-log growth exponent of each column (about 1 =
linear). ``--rows N`` instead runs only the reader comparison at ``N`` rows
(the 20M check) for the Amazon-like CSV and an ML-20M-like ``ratings.csv``
(``userId,movieId,rating,timestamp``, sorted by user and then item, as ML-20M
is), plus the cache's open time.

    python bench/scale.py                     # 1e5 and 1e6 interactions, then report
    python bench/scale.py --large             # + 1e7
    python bench/scale.py --cases 1e7 --steps read,pandas,cache   # one case, some steps
    python bench/scale.py --cases 1e7 --steps train:ce_chunked
    python bench/scale.py report              # the table from the JSON
    python bench/scale.py --rows 20000000     # readers vs pandas at 20M rows

Not a test: times depend on the machine and its load. pandas is only needed
here, not by the library: ``pip install -e ".[bench]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's bft_lightning, as the child processes get
sys.path.insert(0, str(REPO / "bench"))
from common.hardware import commit, load_averages, peak_rss_gib  # noqa: E402

# label: (interactions, items, timed training batches, evaluated users; 0 = all)
CASES = {"1e5": (100_000, 10_000, 20, 0), "1e6": (1_000_000, 100_000, 20, 0)}
LARGE = {"1e7": (10_000_000, 1_000_000, 3, 4096)}
LOSSES = ("ce", "ce_chunked", "sampled_softmax_logq", "bce")
BATCH, MAX_LEN, D_MODEL, EVAL_BATCH = 32, 50, 32, 1024
TILE_USERS, TILE_COLUMNS = 512, 4096  # the bound's score tiles, as the library's ranking


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", nargs="?", default="run", choices=("run", "report"))
    p.add_argument("--large", action="store_true", help="add the 1e7-interaction case")
    p.add_argument("--cases", default="", help="comma-separated labels (1e5,1e6,1e7)")
    p.add_argument("--steps", default="", help="read,pandas,cache,train:<loss>,eval (default all)")
    p.add_argument("--rows", type=int, default=0, help="only the reader comparison at N rows")
    p.add_argument("--workdir", default="/tmp/bft_scale")
    p.add_argument("--json", default=str(REPO / "results" / "perf" / "scale.json"))
    p.add_argument("--out", default=str(REPO / "results" / "perf" / "scale.table.md"))
    p.add_argument("--train-batches", type=int, default=0, help="0: the case's default")
    p.add_argument("--eval-users", type=int, default=-1, help="-1: the case's default, 0: all")
    p.add_argument("--ce-limit-gb", type=float, default=8.0)
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--path", default="", help=argparse.SUPPRESS)
    p.add_argument("--spec", default="", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def make_log(n: int, items: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(user, item, time)`` rows in global time order: geometric lengths, Zipf items."""
    rng = np.random.default_rng(seed)
    lengths = rng.geometric(0.1, size=n // 5)
    lengths = lengths[np.cumsum(lengths) <= n]
    lengths = np.append(lengths, n - lengths.sum()) if lengths.sum() < n else lengths
    lengths = lengths[lengths > 0]
    user = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    ranks = np.arange(1, items + 1, dtype=np.float64) ** -1.1
    item = rng.choice(items, size=n, p=ranks / ranks.sum()).astype(np.int64)
    start = rng.integers(1_300_000_000, 1_600_000_000, size=len(lengths))
    gaps = rng.integers(1, 86_400 * 30, size=n)
    cum = np.cumsum(gaps)  # each user's first item at its start, then increasing gaps
    times = np.repeat(start, lengths) + cum - np.repeat(cum[np.cumsum(lengths) - lengths], lengths)
    order = np.argsort(times, kind="stable")
    perm = rng.permutation(len(lengths))  # user ids not in order of first appearance
    return perm[user[order]], item[order], times[order]


def write_csv(path: Path, rows: tuple[np.ndarray, np.ndarray, np.ndarray], kind: str) -> None:
    """``amazon``: headerless ``B%09d,A%013d,5.0,t``; ``ml``: ``userId,movieId,rating,t``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    user, item, times = rows
    if path.exists():
        return
    tmp = path.with_suffix(".tmp")
    chunk = 2_000_000
    with pa.OSFile(str(tmp), "wb") as sink:
        if kind == "ml":
            sink.write(b"userId,movieId,rating,timestamp\n")
        for a in range(0, len(user), chunk):
            u = pa.array(user[a : a + chunk]).cast(pa.string())
            i = pa.array(item[a : a + chunk]).cast(pa.string())
            t = pa.array(times[a : a + chunk]).cast(pa.string())
            if kind == "amazon":
                i2 = pc.binary_join_element_wise("B", pc.utf8_lpad(i, 9, "0"), "")
                u2 = pc.binary_join_element_wise("A", pc.utf8_lpad(u, 13, "0"), "")
                line = pc.binary_join_element_wise(i2, u2, "5.0", t, ",")
            else:
                line = pc.binary_join_element_wise(u, i, "4.5", t, ",")
            line = (
                pc.binary_join_element_wise(line, "", "\n").combine_chunks()
                if isinstance(line, pa.ChunkedArray)
                else pc.binary_join_element_wise(line, "", "\n")
            )
            offsets = np.frombuffer(line.buffers()[1], dtype=np.int32)[: len(line) + 1]
            sink.write(line.buffers()[2][offsets[0] : offsets[-1]])
    tmp.rename(path)


# ----------------------------------------------------------------------------- children


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _log_bytes(log) -> int:  # type: ignore[no-untyped-def]
    total = log.item_codes.nbytes + log.offsets.nbytes
    total += 0 if log.times is None else log.times.nbytes
    for vocab in (log.user_vocab, log.item_vocab):
        total += vocab.nbytes
        if vocab.dtype == object:
            total += sum(sys.getsizeof(v) for v in vocab.tolist())
    return total


def _warm_up(path: str) -> None:
    """One tiny read first: pyarrow's first call sets up its thread pool and kernels
    (about a second here), as pandas' imports before its timer set up its own."""
    from bft_lightning.datamodules.readers import read_interactions

    tiny = Path(path).parent / "warm-up.csv"
    tiny.write_text("B000000001,A1,5.0,1\nB000000002,A1,5.0,2\n")
    read_interactions(tiny, "amazon", kcore=0)


def child_read(path: str, kind: str) -> dict[str, float]:
    from bft_lightning.datamodules.readers import kcore_filter, read_interactions
    from bft_lightning.datamodules.splits import encode, eval_arrays, leave_one_out, train_arrays

    _warm_up(path)
    base = _rss_mb()
    t0 = time.perf_counter()
    log = read_interactions(path, "amazon", kcore=0)
    read_s = time.perf_counter() - t0
    peak = _peak_mb() - base
    final = _log_bytes(log) / 2**20
    t0 = time.perf_counter()
    core = kcore_filter(log, 5)
    kcore_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = encode(core)
    split = leave_one_out(data)
    train_arrays(data, split, 50)
    eval_arrays(data, split, 50, "val")
    eval_arrays(data, split, 50, "test")
    split_s = time.perf_counter() - t0
    digest = int(np.sum(log.item_codes[::97]) + log.offsets[-1] + log.num_users)
    return {
        "read_s": read_s, "kcore_s": kcore_s, "split_s": split_s, "peak_mb": peak,
        "final_mb": final, "rows": log.num_interactions, "users": log.num_users,
        "check": float(np.sum(np.diff(log.offsets) ** 2)), "digest": digest,
        "peak_rss_gib": peak_rss_gib(),
    }  # fmt: skip


def child_pandas(path: str, kind: str) -> dict[str, float]:
    import pandas as pd

    base = _rss_mb()
    t0 = time.perf_counter()
    if kind == "amazon":
        df = pd.read_csv(
            path, header=None, names=["item", "user", "rating", "timestamp"],
            usecols=["item", "user", "timestamp"],
            dtype={"item": str, "user": str, "timestamp": np.int64},
        )  # fmt: skip
    else:
        df = pd.read_csv(path, usecols=["userId", "movieId", "timestamp"], dtype=np.int64).rename(
            columns={"userId": "user", "movieId": "item"}
        )
    ucodes, users = pd.factorize(df["user"])
    icodes, _ = pd.factorize(df["item"])
    order = np.lexsort((df["timestamp"].to_numpy(), ucodes))  # per user, by time, stable
    items = icodes[order]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(ucodes, minlength=len(users)))])
    read_s = time.perf_counter() - t0
    return {
        "pandas_s": read_s, "pandas_peak_mb": _peak_mb() - base, "rows": len(items),
        "check": float(np.sum(np.diff(offsets) ** 2)), "peak_rss_gib": peak_rss_gib(),
    }  # fmt: skip


def child_ml(path: str, kind: str) -> dict[str, float]:
    from bft_lightning.datamodules.readers import read_interactions

    _warm_up(path)
    base = _rss_mb()
    t0 = time.perf_counter()
    log = read_interactions(path, "amazon", kcore=0)  # a ratings.csv with a header
    return {
        "read_s": time.perf_counter() - t0, "peak_mb": _peak_mb() - base,
        "final_mb": _log_bytes(log) / 2**20, "rows": log.num_interactions,
        "check": float(np.sum(np.diff(log.offsets) ** 2)),
    }  # fmt: skip


def child_cache(path: str, kind: str) -> dict[str, float]:
    from bft_lightning.datamodules import cache as c

    folder = Path(path).parent / "cache"
    t0 = time.perf_counter()
    c.load_sequences(path, "amazon", 0, folder)
    build = time.perf_counter() - t0
    base = _rss_mb()
    t0 = time.perf_counter()
    data = c.load_sequences(path, "amazon", 0, folder)  # hashes the source, then maps
    open_s = time.perf_counter() - t0
    key = c.cache_key(c.source_files(path), {"format": "amazon", "kcore": 0})
    t0 = time.perf_counter()
    mapped = c.load_cached(c.cache_path(folder, Path(path).name, key), key)
    map_s = time.perf_counter() - t0
    assert mapped is not None and len(mapped.items) == len(data.items)
    return {"cache_build_s": build, "cache_open_s": open_s, "cache_map_s": map_s,
            "cache_open_rss_mb": _rss_mb() - base, "cache_rows": len(data.items),
            "peak_rss_gib": peak_rss_gib()}  # fmt: skip


def _datamodule(path: str, work: Path):  # type: ignore[no-untyped-def]
    from bft_lightning.datamodules import SequenceDataModule

    return SequenceDataModule(path=path, format="amazon", kcore=0, max_len=MAX_LEN,
                              batch_size=BATCH, eval_batch_size=EVAL_BATCH,
                              cache_dir=str(work / "dm_cache"))  # fmt: skip


def _task(num_items: int, loss: str = "ce"):  # type: ignore[no-untyped-def]
    from functools import partial

    from bft_lightning.models import SASRec
    from bft_lightning.tasks import SequentialRecommendation

    return SequentialRecommendation(
        num_items, MAX_LEN, backbone=partial(SASRec, d_model=D_MODEL), loss=loss
    )


def _trainer(**kwargs):  # type: ignore[no-untyped-def]
    import lightning as L

    return L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, accelerator="cpu", **kwargs)  # fmt: skip


def child_train(path: str, spec: str) -> dict[str, float | str]:
    """``trainer.fit`` of one loss over ``batches + 1`` batches, the first a warm-up."""
    import torch

    args = json.loads(spec)
    torch.set_num_threads(1)  # one thread: CPU time is then the work, whatever the load
    torch.manual_seed(0)
    loss = args["loss"]
    t0 = time.perf_counter()
    dm = _datamodule(path, Path(args["workdir"]))
    dm.setup("fit")
    setup_s = time.perf_counter() - t0
    out: dict[str, float | str] = {"setup_s": setup_s, "num_items": dm.num_items}
    logits_gb = 3 * BATCH * (MAX_LEN - 1) * (dm.num_items + 1) * 4 / 2**30
    if loss == "ce" and logits_gb > args["ce_limit_gb"]:
        out["note"] = (f"ce not run: its logits, softmax and gradient need {logits_gb:.1f} GiB "
                       f"a batch of {BATCH} rows (over {args['ce_limit_gb']:g} GiB)")  # fmt: skip
        out["peak_rss_gib"] = peak_rss_gib()
        return out
    task = _task(dm.num_items, loss)
    timer = _timer_class()()
    trainer = _trainer(max_epochs=1, limit_train_batches=args["batches"] + 1,
                       limit_val_batches=0, callbacks=[timer])  # fmt: skip
    trainer.fit(task, datamodule=dm)
    out |= {f"train_{loss}_s_per_M": timer.seconds / max(timer.targets, 1) * 1e6,
            f"train_{loss}_cpu_s_per_M": timer.cpu / max(timer.targets, 1) * 1e6,
            "batches": timer.seen - 1, "targets": timer.targets,
            "peak_rss_gib": peak_rss_gib()}  # fmt: skip
    return out


def child_eval(path: str, spec: str) -> dict[str, float]:
    """``trainer.validate`` of an untrained task (full ranking) over the first
    ``users`` evaluated users, and the bound: the float32 score product alone."""
    import torch

    args = json.loads(spec)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dm = _datamodule(path, Path(args["workdir"]))
    dm.setup("validate")
    total = len(dm.split.eval_users)
    users = total if args["users"] <= 0 else min(args["users"], total)
    batches = -(-users // EVAL_BATCH)
    users = min(batches * EVAL_BATCH, total)  # whole batches
    task = _task(dm.num_items)
    loop = _loop_timer_class()()
    trainer = _trainer(limit_val_batches=batches, callbacks=[loop])
    t0 = time.perf_counter()
    trainer.validate(task, datamodule=dm, verbose=False)
    validate_s = time.perf_counter() - t0
    a, b = torch.randn(users, D_MODEL), torch.randn(dm.num_items + 1, D_MODEL)
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, users, EVAL_BATCH):  # a full (batch, items + 1) product per batch
        a[s : s + EVAL_BATCH] @ b.T
    dense_s, dense_cpu = time.perf_counter() - t0, time.process_time() - c0
    buf = torch.empty(TILE_USERS, TILE_COLUMNS)  # the same products, one reused tile at a time
    t0, c0 = time.perf_counter(), time.process_time()
    for s in range(0, users, TILE_USERS):
        rows = a[s : s + TILE_USERS]
        for j in range(0, b.shape[0], TILE_COLUMNS):
            cols = b[j : j + TILE_COLUMNS]
            torch.mm(rows, cols.T, out=buf[: len(rows), : len(cols)])
    bound_s, bound_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"eval_s": loop.seconds, "validate_s": validate_s, "bound_s": bound_s,
            "eval_cpu_s": loop.cpu, "bound_cpu_s": bound_cpu, "dense_product_s": dense_s,
            "dense_product_cpu_s": dense_cpu,
            "eval_full_cpu_s": loop.cpu * total / users,
            "bound_full_cpu_s": bound_cpu * total / users,
            "eval_users": users, "eval_users_total": total,
            "eval_full_s": loop.seconds * total / users, "bound_full_s": bound_s * total / users,
            "num_items": dm.num_items, "peak_rss_gib": peak_rss_gib()}  # fmt: skip


def child_optim(path: str, spec: str) -> dict[str, float]:
    """The task's AdamW step alone, over a SASRec of the case's catalogue (dense
    gradients, as after a backward pass): a per-batch cost that grows with the
    items whatever the loss."""
    import torch

    args = json.loads(spec)
    torch.set_num_threads(1)
    task = _task(args["num_items"])
    opt = task.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else opt
    for q in task.parameters():
        q.grad = torch.randn_like(q)
    opt.step()  # warm-up: the state is allocated
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args["steps"]):
        opt.step()
    n = args["steps"]
    return {"optim_step_s": (time.perf_counter() - t0) / n,
            "optim_step_cpu_s": (time.process_time() - c0) / n,
            "params": sum(q.numel() for q in task.parameters()),
            "peak_rss_gib": peak_rss_gib()}  # fmt: skip


def _loop_timer_class():  # type: ignore[no-untyped-def]
    import lightning as L

    class LoopTimer(L.Callback):
        """Seconds of the validation loop: its first batch to its epoch end (metrics)."""

        def __init__(self) -> None:
            self.seconds, self.cpu, self._t, self._c = 0.0, 0.0, 0.0, 0.0

        def on_validation_epoch_start(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
            self._t, self._c = time.perf_counter(), time.process_time()

        def on_validation_epoch_end(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
            self.seconds = time.perf_counter() - self._t
            self.cpu = time.process_time() - self._c

    return LoopTimer


def _timer_class():  # type: ignore[no-untyped-def]
    import lightning as L

    class BatchTimer(L.Callback):
        """Seconds and targets of the training batches after the first (warm-up)."""

        def __init__(self) -> None:
            self.seconds, self.cpu, self.targets, self.seen = 0.0, 0.0, 0, 0
            self._t = self._c = 0.0

        def on_train_batch_start(self, trainer, module, batch, idx) -> None:  # type: ignore[no-untyped-def]
            self._t, self._c = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:  # type: ignore[no-untyped-def]
            self.seen += 1
            if self.seen > 1:
                self.seconds += time.perf_counter() - self._t
                self.cpu += time.process_time() - self._c
                self.targets += int((batch["seq"][:, 1:] != 0).sum())

    return BatchTimer


CHILDREN = {"read": child_read, "pandas": child_pandas, "ml": child_ml, "cache": child_cache,
            "train": child_train, "eval": child_eval, "optim": child_optim}  # fmt: skip


def run_child(step: str, path: Path, spec: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", step, "--path", str(path), "--spec", spec]
    extra = os.environ.get("PYTHONPATH", "")  # e.g. where pandas is installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(REPO), extra) if x))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{step} on {path} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- driver


def prefix_memory(n_users: int, mean_len: float, max_len: int = 200) -> dict[str, float]:
    """Materialised prefix rows against PrefixRows' state, for a log of this size."""
    from bft_lightning.datamodules.splits import SequenceData, leave_one_out
    from bft_lightning.datamodules.windows import PrefixRows

    rng = np.random.default_rng(0)
    lengths = rng.geometric(1 / mean_len, size=n_users)
    n = int(lengths.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data = SequenceData(
        np.ones(n, np.int64), offsets, None, 1, np.array([""] * n_users), np.array([""])
    )
    split = leave_one_out(data)
    base = _rss_mb()
    rows = PrefixRows(data, split, max_len)
    lengths = rows.row_lengths()  # what the length-bucket sampler holds
    batch = rows.__getitems__(list(range(0, len(rows), max(len(rows) // 256, 1))))
    grown = _rss_mb() - base
    state = rows.users.nbytes + rows.start.nbytes + rows.first.nbytes
    return {"interactions": n, "rows": len(rows),
            "materialised_gb": len(rows) * (max_len + 1) * 8 / 1e9,
            "state_mb": state / 2**20, "row_lengths_mb": lengths.nbytes / 2**20,
            "rss_growth_mb": grown, "batch_shape": list(batch["seq"].shape)}  # fmt: skip


def growth(xs: list[float], ys: list[float | None]) -> str:
    """Least-squares slope of log y on log x over the points with a positive y."""
    pts = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and y > 0]
    if len(pts) < 2:
        return "-"
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return f"{np.polyfit(lx, ly, 1)[0]:.2f}"


def run_case(label: str, steps: list[str], args: argparse.Namespace, results: dict) -> None:
    """Run ``steps`` of one case, merging each step's result into ``results[label]``."""
    n, items, batches, users = (CASES | LARGE)[label]
    batches = args.train_batches or batches
    users = users if args.eval_users < 0 else args.eval_users
    work = Path(args.workdir)
    path = work / f"amazon_{n}_{items}.csv"
    if not path.exists():
        write_csv(path, make_log(n, items, args.seed), "amazon")
    case = results.setdefault(label, {"n": n, "items": items, "steps": {}})
    for step in steps:
        load, t0 = load_averages(), time.perf_counter()
        if step in ("read", "pandas", "cache"):
            out = run_child(step, path, "amazon")
        elif step.startswith("train:"):
            spec = {"loss": step.split(":", 1)[1], "batches": batches, "workdir": str(work),
                    "ce_limit_gb": args.ce_limit_gb}  # fmt: skip
            out = run_child("train", path, json.dumps(spec))
        elif step == "optim":  # the catalogue of the case's training runs
            items = [s["num_items"] for s in case["steps"].values() if "num_items" in s]
            spec = {"num_items": items[0], "steps": 5}
            out = run_child("optim", path, json.dumps(spec))
        elif step == "eval":
            out = run_child("eval", path, json.dumps({"users": users, "workdir": str(work)}))
        else:
            raise SystemExit(f"unknown step {step!r}: read, pandas, cache, train:<loss>, "
                             "optim, eval")  # fmt: skip
        out |= {"load_before": load, "wall_s": time.perf_counter() - t0, "commit": commit(REPO),
                "date": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
        case["steps"][step] = out
        read, pandas = case["steps"].get("read"), case["steps"].get("pandas")
        if read and pandas:  # the same per-user sequences
            assert read["check"] == pandas["check"] and read["rows"] == pandas["rows"] == n
        print(label, step, json.dumps(out), flush=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child](args.path, args.spec)))
        return
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.rows:
        reader_check(args, work)
        return
    jpath = Path(args.json)
    results = json.loads(jpath.read_text()) if jpath.exists() else {}
    if args.command == "report":
        write_report(Path(args.out), results)
        return
    labels = args.cases.split(",") if args.cases else list(CASES) + (list(LARGE) * args.large)
    default = ["read", "pandas", "cache"] + [f"train:{x}" for x in args.losses.split(",")]
    steps = args.steps.split(",") if args.steps else default + ["optim", "eval"]
    for label in labels:
        if label not in CASES | LARGE:
            raise SystemExit(f"unknown case {label!r}: one of {sorted(CASES | LARGE)}")
        run_case(label, steps, args, results)
    if not args.cases and not args.steps:
        results["prefix"] = prefix_memory(2_000_000, 10.0)
        jpath.write_text(json.dumps(results, indent=1) + "\n")
        write_report(Path(args.out), results)


def reader_check(args: argparse.Namespace, work: Path) -> None:
    """Ours against pandas at ``--rows`` rows, Amazon-like and ML-20M-like."""
    rows = make_log(args.rows, max(args.rows // 20, 1000), args.seed)
    out = {}
    for kind, name in (("amazon", "amazon"), ("ml", "ratings")):
        path = work / f"{name}_{args.rows}.csv"
        if kind == "ml" and not path.exists():  # ML-20M's layout: by user, then by item
            by = np.lexsort((rows[1], rows[0]))
            write_csv(path, (rows[0][by], rows[1][by], rows[2][by]), kind)
        write_csv(path, rows, kind)
        ours = run_child("read" if kind == "amazon" else "ml", path, kind)
        theirs = run_child("pandas", path, kind)
        assert ours["check"] == theirs["check"] and ours["rows"] == theirs["rows"]
        out[kind] = (
            ours
            | theirs
            | {
                "ratio": ours["read_s"] / theirs["pandas_s"],
                "peak_over_final": ours["peak_mb"] / ours["final_mb"],
                "pandas_peak_over_final": theirs["pandas_peak_mb"] / ours["final_mb"],
                "file_mb": path.stat().st_size / 2**20,
            }
        )
        print(kind, json.dumps(out[kind]), flush=True)
    out["cache"] = run_child("cache", work / f"amazon_{args.rows}.csv", "amazon")
    print("cache", json.dumps(out["cache"]), flush=True)
    (work / f"readers_{args.rows}.json").write_text(json.dumps(out, indent=1))


COLUMNS = [
    ("read s", "read", "read_s"), ("pandas s", "pandas", "pandas_s"),
    ("k-core s", "read", "kcore_s"), ("split s", "read", "split_s"),
    ("read peak MB", "read", "peak_mb"), ("final MB", "read", "final_mb"),
    ("cache open s", "cache", "cache_open_s"), ("cache map s", "cache", "cache_map_s"),
    ("model items", "eval", "num_items"),
] + [(f"train {x} CPU s/M", f"train:{x}", f"train_{x}_cpu_s_per_M") for x in LOSSES] + [
    ("AdamW step CPU s", "optim", "optim_step_cpu_s"), ("eval users", "eval", "eval_users"),
    ("eval CPU s", "eval", "eval_cpu_s"),
    ("bound CPU s", "eval", "bound_cpu_s"), ("eval CPU s, all users", "eval", "eval_full_cpu_s"),
    ("bound CPU s, all users", "eval", "bound_full_cpu_s"), ("peak RSS GiB", "", "peak_rss_gib"),
]  # fmt: skip


SAMPLED = {"eval_users", "eval_cpu_s", "bound_cpu_s"}  # over a sample of users where one is set


def _cell(case: dict, step: str, key: str) -> float | None:
    steps = case["steps"]
    if not step:  # the largest peak RSS of the case's steps
        peaks = [s["peak_rss_gib"] for s in steps.values() if "peak_rss_gib" in s]
        return max(peaks) if peaks else None
    value = steps.get(step, {}).get(key)
    return float(value) if isinstance(value, (int, float)) else None


def write_report(path: Path, results: dict) -> None:
    """The markdown table (one row per case, then the growth exponents) from the JSON."""
    cases = sorted((c for k, c in results.items() if k != "prefix"), key=lambda c: c["n"])
    head = "| interactions | items | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for case in cases:
        cells = [_cell(case, step, key) for _, step, key in COLUMNS]
        text = ["-" if v is None else f"{v:.3g}" for v in cells]
        lines.append(f"| {case['n']:.0e} | {case['items']:.0e} | " + " | ".join(text) + " |")
    xs = [float(c["n"]) for c in cases]
    lines.append("| growth exponent | | " + " | ".join(
        "n/a" if key in SAMPLED else growth(xs, [_cell(c, step, key) for c in cases])
        for _, step, key in COLUMNS) + " |")  # fmt: skip
    lines += ["", "| interactions | step | peak RSS GiB | s (process) | load before | commit |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for case in cases:
        for step, out in case["steps"].items():
            peak = out.get("peak_rss_gib")
            shown = "-" if peak is None else f"{peak:.2f}"
            lines.append(f"| {case['n']:.0e} | {step} | {shown} | {out['wall_s']:.1f} | "
                         f"{out['load_before']} | {out['commit']} |")  # fmt: skip
    notes = [
        f"{c['n']:.0e}: {x['note']}" for c in cases for x in c["steps"].values() if "note" in x
    ]
    text = "\n".join(lines) + "\n" + ("\nNotes: " + "; ".join(notes) + "\n" if notes else "")
    if "prefix" in results:
        text += "\nPrefix rows (2e6 users, geometric lengths mean 10, max_len 200): "
        text += json.dumps(results["prefix"]) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
