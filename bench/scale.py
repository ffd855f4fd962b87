"""Scale benchmark: readers, k-core, split, training and evaluation on power-law logs.

Synthetic logs: users with geometric history lengths (mean 10), items drawn
from a Zipf law (exponent 1.1) over ``--items``, times increasing per user and
the file in global time order (users interleaved, as a real log). Each case is
written as an Amazon-like headerless CSV (``item,user,rating,timestamp``,
ASIN-shaped items, 14-character users) under ``--workdir`` (default /tmp).

Per case, each in a fresh process (so peak RSS is the step's own):

- ``read``: ``read_interactions(kcore=0)``; ``pandas``: ``pd.read_csv`` of the
  same columns + ``factorize`` + the stable per-user sort that gives the same
  sequences (checked equal); ``kcore``: ``kcore_filter(log, 5)``; ``split``:
  ``encode`` + ``leave_one_out`` + the train / valid / test arrays;
- peak RSS of the read against the bytes of the final arrays;
- ``train``: seconds per million training targets of one epoch (the first
  ``--train-batches`` batches, timed after one warm-up batch) for each loss
  name in ``--losses`` the task accepts (others are skipped, with a note);
- ``eval``: ``trainer.validate`` against its bound, the float32 score matmul
  (eval users x items x d) alone.

Then the log-log growth exponent of each column over the cases (about 1 =
linear). ``--large`` adds the 1e7-interaction case; ``--rows N`` instead runs
only the reader comparison at ``N`` rows (the 20M check) for the Amazon-like
CSV and an ML-20M-like ``ratings.csv`` (``userId,movieId,rating,timestamp``,
sorted by user and then item, as ML-20M is), plus the cache's open time.

    python bench/scale.py                     # 1e5 and 1e6 interactions, minutes
    python bench/scale.py --large             # + 1e7 (tens of minutes)
    python bench/scale.py --rows 20000000     # readers vs pandas at 20M rows

Not a test: times depend on the machine and its load. pandas is only needed
here (not by the library).
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
CASES = [(100_000, 10_000), (1_000_000, 100_000)]
LARGE = [(10_000_000, 1_000_000)]
LOSSES = ("ce", "ce_chunked", "sampled_softmax", "bce")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--large", action="store_true", help="add the 1e7-interaction case")
    p.add_argument("--rows", type=int, default=0, help="only the reader comparison at N rows")
    p.add_argument("--workdir", default="/tmp/bft_scale")
    p.add_argument("--out", default=str(REPO / "results" / "perf" / "scale.md"))
    p.add_argument("--train-batches", type=int, default=5)
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--path", default="", help=argparse.SUPPRESS)
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
        "check": float(np.sum(np.diff(offsets) ** 2)),
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
            "cache_open_rss_mb": _rss_mb() - base, "cache_rows": len(data.items)}  # fmt: skip


def child_train(path: str, kind: str) -> dict[str, float]:
    from functools import partial

    import lightning as L
    import torch

    from bft_lightning.datamodules import SequenceDataModule
    from bft_lightning.models import SASRec
    from bft_lightning.tasks import SequentialRecommendation

    args = json.loads(kind)
    torch.set_num_threads(2)
    out: dict[str, float] = {}
    notes = []
    dm = SequenceDataModule(path=path, format="amazon", kcore=5, max_len=50, batch_size=32,
                            eval_batch_size=1024)  # fmt: skip
    dm.setup("fit")
    for loss in args["losses"]:
        try:
            task = SequentialRecommendation(
                dm.num_items, 50, backbone=partial(SASRec, d_model=32), loss=loss
            )
        except (ValueError, TypeError) as err:
            notes.append(f"{loss}: skipped ({str(err)[:80]})")
            continue
        timer = _timer_class()()
        trainer = L.Trainer(
            max_epochs=1, limit_train_batches=args["batches"] + 1, limit_val_batches=0,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[timer], accelerator="cpu",
        )  # fmt: skip
        trainer.fit(task, datamodule=dm)
        out[f"train_{loss}_s_per_M"] = timer.seconds / max(timer.targets, 1) * 1e6
    task = SequentialRecommendation(dm.num_items, 50, backbone=partial(SASRec, d_model=32))
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", limit_val_batches=1.0)  # fmt: skip
    t0 = time.perf_counter()
    trainer.validate(task, datamodule=dm, verbose=False)
    out["eval_s"] = time.perf_counter() - t0
    users = len(dm.split.eval_users)
    a, b = torch.randn(users, 32), torch.randn(32, dm.num_items + 1)
    t0 = time.perf_counter()
    for s in range(0, users, 1024):
        a[s : s + 1024] @ b
    out["bound_s"] = time.perf_counter() - t0
    out["notes"] = "; ".join(notes)  # type: ignore[assignment]
    return out


def _timer_class():  # type: ignore[no-untyped-def]
    import lightning as L

    class BatchTimer(L.Callback):
        """Seconds and targets of the training batches after the first (warm-up)."""

        def __init__(self) -> None:
            self.seconds, self.targets, self.seen, self._t = 0.0, 0, 0, 0.0

        def on_train_batch_start(self, trainer, module, batch, idx) -> None:  # type: ignore[no-untyped-def]
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, idx) -> None:  # type: ignore[no-untyped-def]
            self.seen += 1
            if self.seen > 1:
                self.seconds += time.perf_counter() - self._t
                seq = batch["seq"]
                if "num_targets" in batch:
                    self.targets += int(batch["num_targets"].sum())
                else:
                    self.targets += int((seq[:, 1:] != 0).sum())

    return BatchTimer


CHILDREN = {"read": child_read, "pandas": child_pandas, "ml": child_ml, "cache": child_cache,
            "train": child_train}  # fmt: skip


def run_child(step: str, path: Path, kind: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", step, "--path", str(path), "--losses", kind]
    env = dict(os.environ, PYTHONPATH=str(REPO))
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


def growth(xs: list[float], ys: list[float]) -> str:
    pts = [(x, y) for x, y in zip(xs, ys) if y and y > 0]
    if len(pts) < 2:
        return "-"
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return f"{np.polyfit(lx, ly, 1)[0]:.2f}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child](args.path, args.losses)))
        return
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.rows:
        reader_check(args, work)
        return
    rows_out = []
    for n, items in CASES + (LARGE if args.large else []):
        path = work / f"amazon_{n}_{items}.csv"
        write_csv(path, make_log(n, items, args.seed), "amazon")
        ours = run_child("read", path, "amazon")
        theirs = run_child("pandas", path, "amazon")
        assert ours["check"] == theirs["check"] and ours["rows"] == theirs["rows"] == n
        cache = run_child("cache", path, "amazon")
        spec = json.dumps({"losses": args.losses.split(","), "batches": args.train_batches})
        train = run_child("train", path, spec) if n <= 1_000_000 or args.large else {}
        rows_out.append({"n": n, "items": items} | ours | theirs | cache | train)
        print(json.dumps(rows_out[-1]), flush=True)
    prefix = prefix_memory(2_000_000, 10.0)
    write_report(Path(args.out), rows_out, prefix, args)


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


def write_report(path: Path, rows: list[dict], prefix: dict, args: argparse.Namespace) -> None:
    cols = [
        ("read s", "read_s"), ("pandas s", "pandas_s"), ("k-core s", "kcore_s"),
        ("split s", "split_s"), ("read peak MB", "peak_mb"), ("final MB", "final_mb"),
        ("cache open s", "cache_open_s"), ("cache map s", "cache_map_s"),
    ] + [(f"train {x} s/M", f"train_{x}_s_per_M") for x in args.losses.split(",")] + [
        ("eval s", "eval_s"), ("bound s", "bound_s"),
    ]  # fmt: skip
    head = "| interactions | items | " + " | ".join(c[0] for c in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for r in rows:
        cells = [f"{r[k]:.3g}" if isinstance(r.get(k), float) else "-" for _, k in cols]
        lines.append(f"| {r['n']:.0e} | {r['items']:.0e} | " + " | ".join(cells) + " |")
    xs = [float(r["n"]) for r in rows]
    lines.append("| growth exponent | | " + " | ".join(
        growth(xs, [r.get(k) for r in rows]) for _, k in cols) + " |")  # fmt: skip
    notes = sorted({r.get("notes", "") for r in rows} - {""})
    text = "\n".join(lines) + "\n\n" + ("Notes: " + "; ".join(notes) + "\n\n" if notes else "")
    text += "Prefix rows (2e6 users, geometric lengths mean 10, max_len 200): " + json.dumps(prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.with_suffix(".table.md")).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
