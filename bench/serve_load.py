"""A load test of ``python -m bft_lightning serve``, rerunnable, writing results/perf/serving.md.

Steps (each bounded; ``all`` runs them in order):

- ``prepare``: checkpoints in ``--workdir``: SASRec (d=64, 2 layers, max_len 50)
  on Amazon Beauty (12,101 items; a few hundred steps, precision off and on)
  and on a synthetic 1M-item log (sampled softmax, a few dozen steps), with
  the held-out histories each serves.
- ``recall``: at 1M items, the faiss index kinds (HNSW, IVF) against the exact
  tiled lists on the 1M model's own outputs: build time, search time, recall@10;
  and the time of one ranking call, exact against faiss, from 12k to 1M items
  (the crossover). Saves the default index beside each 1M checkpoint.
- ``offline``: the ``recommend`` command's users/s on the same checkpoints.
- ``load``: for each case (catalogue x retrieval x precision) a real server
  process on 127.0.0.1, driven by 1, 8 and 32 concurrent clients (keep-alive
  connections, one request in flight each) for at most ``--seconds`` or
  ``--requests`` each: p50/p95/p99 latency, requests/s, share of non-2xx; one
  more run at 32 clients with 10% malformed bodies.
- ``report``: results/perf/serving.md from the JSON.

    OMP_NUM_THREADS=1 python bench/serve_load.py all --data_root ../shared/data

Not a test: the numbers depend on the host and its load (written down in the report).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from common.hardware import cpu_note  # noqa: E402

CATALOGUES = {"beauty": "amazon-beauty-s3rec", "1m": "synthetic"}
CONCURRENCY = (1, 8, 32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("prepare", "recall", "offline", "load", "report", "all"))
    p.add_argument("--data_root", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--workdir", default="/tmp/bft_serve_load")
    p.add_argument("--out", default=str(REPO / "results" / "perf" / "serving.json"))
    p.add_argument("--seconds", type=float, default=8.0, help="per concurrency level")
    p.add_argument("--requests", type=int, default=2000, help="per concurrency level")
    p.add_argument("--users", type=int, default=2000, help="histories held out per catalogue")
    p.add_argument("--offline-users", type=int, default=0, help="1M: first N (0: all)")
    p.add_argument("--cases", default="", help="comma list of case names to run (default all)")
    p.add_argument("--note", default="", help="the host's load while measuring, for the report")
    return p.parse_args(argv)


def _ckpt(work: Path, catalogue: str, precision: str) -> Path:
    return work / f"{catalogue}_{precision}.ckpt"


# ------------------------------------------------------------------------------ prepare


def prepare_one(args: argparse.Namespace, catalogue: str, precision: str) -> None:
    """Train briefly and save weights + vocabulary; write the held-out histories once."""
    from functools import partial

    import lightning as L
    import torch

    from bft_lightning.datamodules import SequenceDataModule
    from bft_lightning.models import SASRec
    from bft_lightning.tasks import SequentialRecommendation

    work = Path(args.workdir)
    path = _ckpt(work, catalogue, precision)
    if path.exists():
        return
    torch.manual_seed(0)
    big = catalogue == "1m"
    dm = SequenceDataModule(
        dataset=CATALOGUES[catalogue], data_root=args.data_root, max_len=50, batch_size=128,
        **({"synthetic_items": 1_000_000, "synthetic_users": 20_000} if big else {}),
    )  # fmt: skip
    dm.prepare_data()
    dm.setup("fit")
    backbone = partial(SASRec, d_model=64, nhead=2, num_layers=2, dim_feedforward=256,
                       precision=precision)  # fmt: skip
    loss = {"loss": "sampled_softmax_logq", "num_negatives": 2048} if big else {}
    task = SequentialRecommendation(dm.num_items, 50, backbone=backbone, lr=3e-3, **loss)
    trainer = L.Trainer(accelerator="cpu", max_steps=40 if big else 300, limit_val_batches=0,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    trainer.fit(task, datamodule=dm)
    work.mkdir(parents=True, exist_ok=True)
    trainer.save_checkpoint(path, weights_only=True)
    if big:
        grow(path, 1_000_000)
    histories = work / f"{catalogue}_histories.jsonl"
    if not histories.exists():
        seq = dm.sequences
        rng = random.Random(0)
        users = rng.sample(range(seq.num_users), min(args.users, seq.num_users))
        with open(histories, "w") as fh:
            for u in users:
                start, end = int(seq.offsets[u]), int(seq.offsets[u + 1])
                items = [str(seq.item_ids[i]) for i in seq.items[start : end - 1]]
                fh.write(json.dumps({"user": str(seq.user_ids[u]), "items": items}) + "\n")


def grow(path: Path, items: int) -> None:
    """The checkpoint's catalogue grown to ``items``: the synthetic log's users reach only
    some ten thousand of its items, so the trained item vectors are kept and the rest
    drawn around them (a trained vector plus Gaussian noise of half the table's
    per-dimension spread, rescaled to the trained vector's norm), with new raw ids and
    no training count. The encoder, its
    states and the trained items are the model's own."""
    import torch

    from bft_lightning.utils.checkpoint_io import (
        atomic_torch_save,
        content_digest,
        safe_load_checkpoint,
    )

    state = safe_load_checkpoint(path)
    info = state["bft_lightning"]
    weight = state["state_dict"]["model.item_emb.weight"]
    n = int(info["num_items"])
    if n >= items:
        return
    g = torch.Generator().manual_seed(0)
    trained = weight[1 : n + 1]
    picks = torch.randint(0, n, (items - n,), generator=g)
    spread = trained.std(0) * 0.5
    source = trained[picks]
    new = source + torch.randn(items - n, weight.shape[1], generator=g) * spread
    new = new * (source.norm(dim=1, keepdim=True) / new.norm(dim=1, keepdim=True))  # same norm
    tensors = state["state_dict"]
    tensors["model.item_emb.weight"] = torch.cat([weight[: n + 1], new, weight[n + 1 :]])
    for key, t in list(tensors.items()):  # other per-item tensors (BFT's per-item prior)
        if key != "model.item_emb.weight" and key.startswith("model.") and t.ndim:
            if t.shape[0] == n + 1:
                tensors[key] = torch.cat([t, t[1:][picks]])
            elif t.shape[0] == n:
                tensors[key] = torch.cat([t, t[picks]])
    vocab = info["vocabulary"]
    vocab["item_ids"] = list(vocab["item_ids"]) + [f"grown{j}" for j in range(items - n)]
    freq = torch.as_tensor(vocab["item_frequency"])
    vocab["item_frequency"] = torch.cat([freq, torch.zeros(items - n, dtype=freq.dtype)])
    info["num_items"] = items
    atomic_torch_save(state, path, digest=content_digest(state))


def prepare(args: argparse.Namespace) -> None:
    for catalogue in CATALOGUES:
        for precision in ("off", "on"):
            t0 = time.perf_counter()
            prepare_one(args, catalogue, precision)
            print(f"prepare {catalogue} {precision}: {time.perf_counter() - t0:.0f} s", flush=True)


def histories(args: argparse.Namespace, catalogue: str) -> list[list[str]]:
    path = Path(args.workdir) / f"{catalogue}_histories.jsonl"
    return [json.loads(line)["items"] for line in open(path)]


# ------------------------------------------------------------------------------ recall


def _lists(model, hidden, log_prec, exclude, index=None):  # noqa: ANN001, ANN202
    import torch

    from bft_lightning.retrieval import topk

    with torch.no_grad():
        t0 = time.perf_counter()
        top = topk(model, hidden, log_prec, 10, exclude, index=index)
        return top, (time.perf_counter() - t0) / len(hidden) * 1e3


def _row(name: str, config: object, build: float, got, ms: float, exact, exact_ms: float,
         precision: str) -> dict:  # fmt: skip
    hits = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got.ids, exact.ids))
    err = (got.logsumexp - exact.logsumexp).abs()
    return {"precision": precision, "kind": name, "build_s": build, "ms_per_user": ms,
            "exact_ms_per_user": exact_ms, "recall@10": hits / exact.ids.numel(),
            "lse_abs_err_median": float(err.median()), "lse_abs_err_max": float(err.max()),
            "users": len(got.ids), "config": dict(config.__dict__)}  # fmt: skip


def recall_step(args: argparse.Namespace, results: dict) -> None:
    """IVF at 1M on the model's states by nprobe; HNSW on a 100k slice of the same table
    (its 1M build is ~10x that, measured by the slice); the default index saved."""
    import dataclasses

    import torch

    from bft_lightning.retrieval.faiss_index import FaissConfig, ItemIndex
    from bft_lightning.serving import Recommender
    from bft_lightning.serving.histories import left_pad
    from bft_lightning.serving.item_index import index_path_for

    torch.set_num_threads(1)
    rows = []
    for precision in ("off", "on"):
        ckpt = _ckpt(Path(args.workdir), "1m", precision)
        rec = Recommender.from_checkpoint(ckpt)
        model = rec.model
        enc = [rec.encode(h) for h in histories(args, "1m")[:500]]
        ids = left_pad([e.items for e in enc], 50)
        exclude = left_pad([e.items for e in enc], max(len(e.items) for e in enc))
        with torch.no_grad():
            hidden, log_prec = model.last_hidden(ids)
        exact, exact_ms = _lists(model, hidden, log_prec, exclude)
        t0 = time.perf_counter()
        index = ItemIndex.build(model, FaissConfig(kind="ivf"))
        build = time.perf_counter() - t0
        default = index.config.nprobe
        for nprobe in (8, 16, 32, 64, 128):
            index.config = dataclasses.replace(index.config, nprobe=nprobe)
            index._tune()
            got, ms = _lists(model, hidden, log_prec, exclude, index)
            rows.append(_row("ivf", index.config, build, got, ms, exact, exact_ms, precision))
            print(rows[-1], flush=True)
        index.config = dataclasses.replace(index.config, nprobe=default)
        index._tune()
        index.save(index_path_for(ckpt))
        if precision == "off":  # HNSW on the first 100k items of the same table
            rows += hnsw_slice(model, hidden, log_prec)
    results["recall"] = rows
    results["crossover"] = crossover(args)


def hnsw_slice(model, hidden, log_prec) -> list[dict]:  # noqa: ANN001
    """HNSW against IVF on a 100k-item slice of the 1M model (same states)."""
    import torch

    from bft_lightning.models import SASRec
    from bft_lightning.retrieval.faiss_index import FaissConfig, ItemIndex

    n = 100_000
    small = SASRec(n, 50, d_model=64, nhead=2, num_layers=1, dim_feedforward=64).eval()
    with torch.no_grad():
        small.item_emb.weight.copy_(model.item_emb.weight[: n + 1])
    exact, exact_ms = _lists(small, hidden, log_prec, None)
    rows = []
    for config in (FaissConfig(kind="hnsw", hnsw_m=16, ef_construction=40, ef_search=64),
                   FaissConfig(kind="ivf")):  # fmt: skip
        t0 = time.perf_counter()
        index = ItemIndex.build(small, config)
        build = time.perf_counter() - t0
        got, ms = _lists(small, hidden, log_prec, None, index)
        rows.append({**_row(config.kind, config, build, got, ms, exact, exact_ms, "off"),
                     "items": n})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def crossover(args: argparse.Namespace) -> list[dict]:
    """One ``recommend`` call for 1 and 8 histories, exact against faiss, by catalogue size
    (an untrained SASRec: the time does not depend on the weights)."""
    import torch

    from bft_lightning.models import SASRec
    from bft_lightning.serving import Recommender

    out = []
    rng = random.Random(0)
    for n in (12_101, 50_000, 200_000, 1_000_000):
        torch.manual_seed(0)
        model = SASRec(n, 50, d_model=64, nhead=2, num_layers=2, dim_feedforward=256)
        ids = [""] + [str(i) for i in range(1, n + 1)]
        exact = Recommender(model, ids, torch.ones(n + 1))
        t0 = time.perf_counter()
        fast = Recommender(model, ids, torch.ones(n + 1), retrieval="faiss")
        build = time.perf_counter() - t0
        for batch in (1, 8):
            hist = [[str(rng.randint(1, n)) for _ in range(20)] for _ in range(batch)]
            row = {"items": n, "batch": batch, "faiss_build_s": build}
            for name, rec in (("exact", exact), ("faiss", fast)):
                rec.recommend(hist, k=10)  # warm
                t0 = time.perf_counter()
                for _ in range(5):
                    rec.recommend(hist, k=10, exclude_seen=True)
                row[f"{name}_ms"] = (time.perf_counter() - t0) / 5 * 1e3
            out.append(row)
            print(row, flush=True)
    return out


# ------------------------------------------------------------------------------ offline


def offline(args: argparse.Namespace, results: dict) -> None:
    """``recommend``'s users/s: the whole file, less the start-up (one history)."""
    work = Path(args.workdir)
    rows = []
    for catalogue in CATALOGUES:
        lines = (work / f"{catalogue}_histories.jsonl").read_text().splitlines()
        if catalogue == "1m":  # 26 ms a user exact: the first N only
            lines = lines[: args.offline_users or None]
        src = work / f"{catalogue}_offline.jsonl"
        src.write_text("\n".join(lines) + "\n")
        one = work / f"{catalogue}_one.jsonl"
        one.write_text(lines[0] + "\n")
        n = len(lines)
        for precision in ("off", "on"):
            ckpt = _ckpt(work, catalogue, precision)
            env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(REPO))

            def run(path: Path, ckpt: Path = ckpt, env: dict = env) -> float:
                cmd = [sys.executable, "-m", "bft_lightning", "recommend", "--ckpt_path",
                       str(ckpt), "--input", str(path), "--output", str(work / "out.csv"),
                       "--k", "10", "--exclude-seen", "--no-progress"]  # fmt: skip
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=900)
                return time.perf_counter() - t0

            startup = run(one)
            total = run(src)
            rows.append({"catalogue": catalogue, "precision": precision, "users": n,
                         "total_s": total, "startup_s": startup,
                         "users_per_s": n / max(total - startup, 1e-9)})  # fmt: skip
            print(rows[-1], flush=True)
    results["offline"] = rows


# ------------------------------------------------------------------------------ load


class Client:
    """One keep-alive connection; ``post`` returns (status, seconds)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, body: bytes) -> tuple[int, float]:
        t0 = time.perf_counter()
        try:
            self.conn.request("POST", "/recommend", body=body,
                              headers={"Content-Type": "application/json"})  # fmt: skip
            response = self.conn.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            status = 599  # no answer: counted as a failure
        return status, time.perf_counter() - t0


MALFORMED = [b'{"items": ["a"', b'{"k": 3}', b'{"items": ["x"], "k": 0}', b'{"items": 5}',
             b'{"items": ["never-seen-id"]}']  # fmt: skip


def drive(port: int, bodies: list[bytes], clients: int, seconds: float, limit: int,
          malformed: float = 0.0) -> dict:  # fmt: skip
    """``clients`` threads, one request in flight each, until ``limit`` requests or
    ``seconds`` pass: latency percentiles, requests/s, statuses."""
    lock = threading.Lock()
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    sent = [0]
    end = time.perf_counter() + seconds

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        client = Client(port)
        while time.perf_counter() < end:
            with lock:
                if sent[0] >= limit:
                    return
                sent[0] += 1
            bad = malformed and rng.random() < malformed
            body = rng.choice(MALFORMED) if bad else rng.choice(bodies)
            status, seconds_taken = client.post(body)
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
                if not bad:
                    latencies.append(seconds_taken)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3

    total = sum(statuses.values())
    non2xx = sum(v for k, v in statuses.items() if not 200 <= k < 300)
    return {"clients": clients, "requests": total, "seconds": wall, "rps": total / wall,
            "p50_ms": pct(0.50), "p95_ms": pct(0.95), "p99_ms": pct(0.99),
            "non2xx_share": non2xx / max(total, 1), "five_xx": sum(
                v for k, v in statuses.items() if k >= 500), "statuses": statuses,
            "malformed_share": malformed}  # fmt: skip


def start_server(ckpt: Path, retrieval: str, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "bft_lightning",
        "serve",
        "--ckpt_path",
        str(ckpt),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--retrieval",
        retrieval,
        "--log-level",
        "warning",
        "--max-batch-size",
        "32",
        "--batch-timeout",
        "0.002",
    ]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def wait_ready(port: int, proc: subprocess.Popen, limit: float = 600) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not start")


def load(args: argparse.Namespace, results: dict) -> None:
    work = Path(args.workdir)
    wanted = set(filter(None, args.cases.split(",")))
    rows = [r for r in results.get("load", []) if wanted and r["case"] not in wanted]
    port = 18800
    for catalogue in CATALOGUES:
        bodies = [json.dumps({"items": h, "k": 10, "exclude_seen": True}).encode()
                  for h in histories(args, catalogue)]  # fmt: skip
        for retrieval in ("exact", "faiss"):
            for precision in ("off", "on"):
                case = f"{catalogue}-{retrieval}-{precision}"
                if wanted and case not in wanted:
                    continue
                port += 1
                proc = start_server(_ckpt(work, catalogue, precision), retrieval, port,
                                    work / f"{case}.log")  # fmt: skip
                try:
                    startup = wait_ready(port, proc)
                    drive(port, bodies, 8, 2.0, 200)  # warm
                    for clients in CONCURRENCY:
                        row = drive(port, bodies, clients, args.seconds, args.requests)
                        rows.append({"case": case, "startup_s": startup, **row})
                        print(rows[-1], flush=True)
                    if retrieval == "exact" and precision == "off":
                        row = drive(port, bodies, 32, args.seconds, args.requests, malformed=0.1)
                        rows.append({"case": case, "startup_s": startup, **row})
                        print(rows[-1], flush=True)
                finally:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                    rows[-1]["exit_code"] = proc.returncode
    results["load"] = rows


# ------------------------------------------------------------------------------ report


def host() -> str:
    return f"{cpu_note()}, Python {platform.python_version()}"


def report(results: dict, path: Path) -> None:
    lines = ["# Serving: load, faiss and the offline command", "",
             "Written by `bench/serve_load.py report` from `serving.json`. Commands:", "",
             "    OMP_NUM_THREADS=1 python bench/serve_load.py prepare   # checkpoints",
             "    OMP_NUM_THREADS=1 python bench/serve_load.py recall    # faiss at 1M, crossover",
             "    OMP_NUM_THREADS=1 python bench/serve_load.py offline --offline-users 400",
             "    OMP_NUM_THREADS=1 python bench/serve_load.py load --seconds 6 --requests 1500",
             "    python bench/serve_load.py report", "",
             f"Host: {results.get('host', host())}. {results.get('note', '')}", ""]  # fmt: skip
    offline = {(r["catalogue"], r["precision"]): r for r in results.get("offline", [])}
    if results.get("load"):
        lines += ["## The server under load", "",
                  "One server process per case (`serve --max-batch-size 32 --batch-timeout "
                  "0.002`, one model process, `OMP_NUM_THREADS=1`), clients on the same host "
                  "(keep-alive connections, one request in flight each, k=10, exclude_seen), "
                  "held-out histories of the catalogue; latency is the client's.", "",
                  "| case | clients | requests | req/s | p50 ms | p95 ms | p99 ms | non-2xx | "
                  "5xx | offline users/s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in results["load"]:
            cat, _, prec = r["case"].split("-")
            off = offline.get((cat, prec))
            name = r["case"] + (" + 10% malformed" if r["malformed_share"] else "")
            offline_rate = f"{off['users_per_s']:.0f}" if off else ""
            lines.append(
                f"| {name} | {r['clients']} | {r['requests']} | {r['rps']:.0f} | "
                f"{r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['p99_ms']:.1f} | "
                f"{r['non2xx_share']:.1%} | {r['five_xx']} | {offline_rate} |"
            )
        lines.append("")
    if results.get("offline"):
        lines += ["## The offline `recommend` command", "",
                  "| catalogue | precision | users | total s | start-up s | users/s |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in results["offline"]:
            lines.append(
                f"| {r['catalogue']} | {r['precision']} | {r['users']} | "
                f"{r['total_s']:.1f} | {r['startup_s']:.1f} | {r['users_per_s']:.0f} |"
            )
        lines.append("")
    if results.get("recall"):
        lines += [
            "## faiss at 1M items: HNSW against IVF",
            "",
            "On the 1M-item model's own states for held-out histories (exclude_seen), "
            "against the exact tiled lists; one thread.",
            "",
            "| items | precision | index | build s | ms / user | exact ms / user | "
            "recall@10 | log-sum-exp error (median / max) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in results["recall"]:
            kind = r["kind"] + (
                f" nprobe {r['config']['nprobe']}"
                if r["kind"] == "ivf"
                else f" M {r['config']['hnsw_m']} ef {r['config']['ef_search']}"
            )
            items = f"{r.get('items', 1_000_000):,}"
            lines.append(f"| {items} | {r['precision']} | {kind} | {r['build_s']:.0f} | "
                         f"{r['ms_per_user']:.2f} | {r['exact_ms_per_user']:.2f} | "
                         f"{r['recall@10']:.4f} | {r['lse_abs_err_median']:.4f} / "
                         f"{r['lse_abs_err_max']:.4f} |")  # fmt: skip
        lines.append("")
    if results.get("crossover"):
        lines += ["## Exact against faiss by catalogue size (the crossover)", "",
                  "One `Recommender.recommend` call (k=10, exclude_seen, histories of 20 "
                  "items), untrained SASRec d=64, one thread.", "",
                  "| items | histories | exact ms | faiss ms | faiss build s |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in results["crossover"]:
            lines.append(
                f"| {r['items']:,} | {r['batch']} | {r['exact_ms']:.1f} | "
                f"{r['faiss_ms']:.1f} | {r['faiss_build_s']:.0f} |"
            )
        lines.append("")
    lines += results.get("findings", [])
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    steps = (
        ["prepare", "recall", "offline", "load", "report"] if args.step == "all" else [args.step]
    )
    for step in steps:
        if step == "prepare":
            prepare(args)
            continue
        if step == "recall":
            recall_step(args, results)
        elif step == "offline":
            offline(args, results)
        elif step == "load":
            load(args, results)
        if step != "report":
            results["host"] = host()
            if args.note:
                results["note"] = args.note
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
        report(results, out.with_suffix(".md"))


if __name__ == "__main__":
    main()
