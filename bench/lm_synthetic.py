"""Noisy SFT on generated extractive QA (``bft_lightning.lm.data.synthetic_qa``).

A task a small Llama-style model learns well on a CPU, so that label noise and
distractors have room to hurt (the SQuAD CPU protocol of ``reproduce_lm.py``
stays below 1% EM). Stages:

1. ``pretrain``: one shared model, language modelling on the task's passages
   (with self-supervised "recall" restatements, no question template), exported
   in Llama format to ``--work/base-<model>``; done once, reused by every run;
2. ``sft``: for each method x noise x distractors x seed, a short SFT from that
   base (off: cross-entropy; bft: precision on, calibrated, cross-entropy;
   focal: gamma 2; label_smoothing: 0.1), then greedy answers on the clean test
   questions (the same 500 for every run) and, for BFT, the Kalman gain K at the
   answer positions whose training label was corrupted against the clean ones.
   Each run writes ``results/lm/synthetic_runs/<name>.json`` and is skipped
   when that file exists (resumable); ``--shard i/n`` takes every n-th run, so
   two 1-thread jobs can share a grid;
3. ``report``: ``results/lm/summary.json`` (one row per method x noise x
   distractors, EM/F1 fractions, paired differences against ``off`` over the
   same test questions and seeds), ``results/lm/synthetic_tables.md`` and the
   plot ``results/lm/synthetic_em_vs_noise.png``.

Run (1 thread each; see docs/lm.md for the measured cost per run)::

    OMP_NUM_THREADS=1 nice -n 5 python bench/lm_synthetic.py --stage pretrain
    OMP_NUM_THREADS=1 nice -n 5 python bench/lm_synthetic.py --stage sft \\
        --methods off bft --noise 0 0.1 0.3 --distractors 0 --seeds 0 1 2
    python bench/lm_synthetic.py --stage report
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pretrain as pt  # noqa: E402
from common.paired import mean_se, paired_runs  # noqa: E402
from common.runs import read_runs, save_run  # noqa: E402

from bft_lightning.lm.data.synthetic_qa import (  # noqa: E402
    FACT_ORDERS,
    SyntheticQADataModule,
    SyntheticQAPretrainDataModule,
    collate_synthetic,
)
from bft_lightning.lm.metrics import qa_scores  # noqa: E402
from bft_lightning.lm.model import BFTOptions, LlamaConfig  # noqa: E402
from bft_lightning.lm.task import LanguageSFT  # noqa: E402
from bft_lightning.nn.filter import FilterConfig  # noqa: E402
from bft_lightning.nn.stats import set_recording  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "results" / "lm"
METHODS: dict[str, dict[str, Any]] = {  # name -> LanguageSFT options
    "off": {"loss": "ce", "precision": "off"},
    "bft": {"loss": "ce", "precision": "on"},
    "focal": {"loss": "focal", "precision": "off"},
    "label_smoothing": {"loss": "ce", "precision": "off", "label_smoothing": 0.1},
}
MODELS = {  # Llama-style sizes (the vocabulary is the generator's, 284 ids)
    "d128": dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
    "d128l2": dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
    "d256l2": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
    ),
    "d192": dict(
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
    "d256": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
    # 10.8M parameters: the size a GPU trains in minutes (bench/gpu/lm_study.sh)
    "d384": dict(
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=6,
    ),
}
ACCELERATOR = "cpu"  # --accelerator: every Trainer of this script runs there
DATA = dict(
    num_train=2000,
    num_val=100,
    num_test=500,
    max_distractors=4,
    facts_per_passage=4,
    max_value_words=3,
    fact_order="entity_first",
    data_seed=0,
)


def model_config(name: str, vocab: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **MODELS[name],
    )


def pretrain(
    work: Path,
    model: str,
    steps: int,
    lr: float,
    init: Path | None = None,
    data_seed: int = 0,
    recall: int = 4,
    seq_len: int = 64,
    copy_passages: int = 0,
) -> dict[str, Any]:
    """Pretrain (or, from ``init``, continue pretraining) the shared base model."""
    base = work / f"base-{model}"

    def build() -> tuple[LanguageSFT, SyntheticQAPretrainDataModule]:
        dm = SyntheticQAPretrainDataModule(
            num_documents=max(steps * 32 // 2, 2000),
            recall_per_document=recall,
            seq_len=seq_len,
            copy_passages=copy_passages,
            batch_size=32,
            eval_batch_size=64,
            **(DATA | {"data_seed": data_seed}),  # type: ignore[arg-type]
        )
        task = LanguageSFT(
            None if init else model_config(model, dm.vocab_size),
            checkpoint_dir=str(init) if init else None,
            lr=lr,
            weight_decay=0.1,
            warmup_steps=50,
            cosine=True,
            generate=False,
            export_dir=str(base),
        )
        return task, dm

    def record(fit: pt.Fit) -> dict[str, Any]:
        fit.dm.tokenizer.save(str(base / "tokenizer.json"))
        return {
            "model": model,
            "steps": steps,
            "lr": lr,
            "seconds": fit.seconds,
            "init": str(init) if init else None,
            "data_seed": data_seed,
            "recall_per_document": recall,
            "copy_passages": copy_passages,
            "seq_len": seq_len,
            "params": sum(p.numel() for p in fit.task.model.parameters()),
            "val_loss": float(fit.trainer.callback_metrics["val/loss"]),
            "train_loss_trace": fit.trace,
            "packing": fit.dm.packing,
            # training tokens with a target (padding excluded), expected over the rows drawn
            "tokens": round(
                steps * 32 * float(np.mean([len(c) - 1 for c in fit.dm.chunks["train"]]))
            ),
        }

    return pt.pretrain(
        work / f"pretrain-{model}.json", work, steps, build, record, accelerator=ACCELERATOR,
        every=25, limit_val_batches=10, val_check_interval=max(steps // 2, 1),
    )  # fmt: skip


@torch.no_grad()
def gain_by_corruption(task: LanguageSFT, dm: SyntheticQADataModule, n: int = 1024) -> dict:
    """Mean Kalman gain per layer at answer positions with a corrupted vs a clean label.

    ``target``: the position whose output predicts the label (what the loss reads);
    ``token``: the position that reads the answer token (the corrupted token itself
    when the noise is in the inputs, else the clean one).
    """
    device = "cuda" if ACCELERATOR in ("gpu", "cuda") else "cpu"
    model = task.model.eval().to(device)  # Lightning hands the model back on the CPU
    items = dm.encoded["train"][:n]  # examples with and without corrupted labels
    if not any(e.corrupted for e in items):
        return {}
    set_recording(model, True)
    acc: dict[str, list[list[float]]] = {}
    for i in range(0, len(items), 64):
        b = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in collate_synthetic(items[i : i + 64]).items()
        }
        model(b["input_ids"], b["attention_mask"])
        answer = (b["labels"] != -100).clone()
        eos = b["labels"] == 2
        answer &= ~eos
        bad = b["label_corrupted"]
        good = answer & ~bad
        bad_tok = torch.zeros_like(bad)
        good_tok = torch.zeros_like(bad)
        bad_tok[:, 1:], good_tok[:, 1:] = bad[:, :-1], good[:, :-1]
        for li, layer in enumerate(model.model.decoder_layers):
            st = layer.last_stats
            assert st is not None
            g = st.gain.mean(-1)  # (B, T): mean over groups
            for key, m in (
                ("target_corrupted", bad),
                ("target_clean", good),
                ("token_corrupted", bad_tok),
                ("token_clean", good_tok),
            ):
                acc.setdefault(key, [[] for _ in model.model.decoder_layers])[li] += g[m].tolist()
    set_recording(model, False)
    out: dict[str, Any] = {}
    for key, layers in acc.items():
        out[key] = [float(np.mean(v)) if v else float("nan") for v in layers]
        out[key + "_n"] = len(layers[0])
    # a paired-free summary: difference corrupted - clean per layer, with its SE
    for where in ("target", "token"):
        diffs, ses = [], []
        for a, b_ in zip(acc[f"{where}_corrupted"], acc[f"{where}_clean"]):
            x, y = np.asarray(a), np.asarray(b_)
            diffs.append(float(x.mean() - y.mean()))
            ses.append(float(math.sqrt(x.var(ddof=1) / len(x) + y.var(ddof=1) / len(y))))
        out[f"{where}_diff"], out[f"{where}_diff_se"] = diffs, ses
    return out


def run_name(method: str, noise: float, k: int, seed: int, in_inputs: bool = False) -> str:
    return f"{method}_np{noise:g}{'i' if in_inputs and noise else ''}_k{k}_s{seed}"


def run_sft(work: Path, a: argparse.Namespace, method: str, noise: float, k: int, seed: int):
    name = run_name(method, noise, k, seed, a.noise_in_inputs)
    file = a.out / "synthetic_runs" / f"{name}.json"
    if file.is_file():
        return json.loads(file.read_text())
    opts = dict(METHODS[method])
    precision = opts.pop("precision")
    L.seed_everything(seed)
    t_data = time.time()
    dm = SyntheticQADataModule(
        num_distractors=k,
        noise_rate=noise,
        noise_in_inputs=a.noise_in_inputs,
        seed=seed,
        batch_size=a.batch_size,
        **DATA,  # type: ignore[arg-type]
    )
    dm.setup()
    t_data = time.time() - t_data
    task = LanguageSFT(
        checkpoint_dir=str(work / f"base-{a.model}"),
        bft=BFTOptions(filter=FilterConfig(precision=precision)),
        focal_gamma=2.0,
        lr=a.lr,
        warmup_steps=10,
        cosine=True,
        max_new_tokens=DATA["max_value_words"] + 1,
        target_gain=0.95,
        **opts,
    )
    trace = pt.LossTrace(every=25)
    t0 = time.time()
    trainer = pt.lm_trainer(
        work, ACCELERATOR, max_steps=a.sft_steps, callbacks=[trace], limit_val_batches=0
    )
    trainer.fit(task, dm)
    fit_s = time.time() - t0
    t1 = time.time()
    res = trainer.test(task, dm, verbose=False)[0]
    test_s = time.time() - t1
    per_q = {
        p["id"]: [round(v, 4) for v in qa_scores(p["prediction"], p["answers"])]
        for p in task.predictions
    }
    result: dict[str, Any] = {
        "name": name,
        "method": method,
        "noise_rate": noise,
        "distractors": k,
        "seed": seed,
        "model": a.model,
        "sft_steps": a.sft_steps,
        "batch_size": a.batch_size,
        "lr": a.lr,
        "noise_in_inputs": a.noise_in_inputs,
        "corrupted_fraction": dm.corrupted_fraction,
        "data": dict(DATA),
        "pretrain": json.loads((work / f"pretrain-{a.model}.json").read_text()),
        "test_em": res["test/em"],
        "test_f1": res["test/f1"],
        "test_loss": res["test/loss"],
        "fit_seconds": round(fit_s, 1),
        "test_seconds": round(test_s, 1),
        "data_seconds": round(t_data, 1),
        "train_loss_trace": trace.trace,
        "per_question": per_q,
        "examples": [p for p in task.predictions[:5]],
    }
    if precision == "on":
        rep = task.calibration_report
        result["calibration"] = {"median_gain": rep.median_gain, "q": rep.q}
        if noise > 0:
            result["gain_by_corruption"] = gain_by_corruption(task, dm)
    return save_run(file, result)


# --------------------------------------------------------------------------- report
def _paired(runs: list[dict], method: str, noise: float, k: int, metric: int) -> tuple:
    """Mean per-question difference method - off (same question, same seed) and its SE."""
    values = lambda r: {q: v[metric] for q, v in r["per_question"].items()}  # noqa: E731
    return paired_runs(runs, method, "off", noise, k, values, empty=None)


def _squad_cpu_runs(out: Path) -> list[dict]:
    """The SQuAD CPU runs of ``reproduce_lm.py`` (``results/lm/runs``), ``sft`` as ``off``."""
    return [r | {"method": "off" if r["method"] == "sft" else r["method"]}
            for r in read_runs(out / "runs")]  # fmt: skip


def _rows(runs: list[dict], task: str) -> list[dict]:
    rows = []
    conds = sorted({(r["noise_rate"], r["distractors"]) for r in runs})
    for noise, k in conds:
        for m in METHODS:
            rs = [
                r for r in runs if (r["method"], r["noise_rate"], r["distractors"]) == (m, noise, k)
            ]
            if not rs:
                continue
            em, em_se = mean_se([r["test_em"] for r in rs], single=None)
            f1, f1_se = mean_se([r["test_f1"] for r in rs], single=None)
            d, se, n = _paired(runs, m, noise, k, 0) if m != "off" else (0.0, 0.0, 0)
            df1, sef1, _ = _paired(runs, m, noise, k, 1) if m != "off" else (0.0, 0.0, 0)
            row = {
                "task": task,
                "method": m,
                "noise": noise,
                "distractors": k,
                "seeds": sorted(r["seed"] for r in rs),
                # the model's size (the pretraining's own record; None for runs without one)
                "model": rs[0].get("model"),
                "params": rs[0].get("pretrain", {}).get("params"),
                "em": em,
                "f1": f1,
                "paired_delta_em": d,
                "paired_se_em": se,
                "em_se_seeds": em_se,
                "f1_se_seeds": f1_se,
                "paired_delta_f1": df1,
                "paired_se_f1": sef1,
                "paired_n": n,
                "fit_seconds_mean": float(np.mean([r["fit_seconds"] for r in rs])),
            }
            gains = [  # runs whose sample had both corrupted and clean answer labels
                g
                for r in rs
                if (g := r.get("gain_by_corruption")) and g.get("target_clean_n", 0) > 0
            ]
            if gains:
                row["gain_K"] = {
                    key: np.mean([g[key] for g in gains], axis=0).round(4).tolist()
                    for key in (
                        "target_corrupted",
                        "target_clean",
                        "target_diff",
                        "token_corrupted",
                        "token_clean",
                        "token_diff",
                    )
                }
                for pos in ("target", "token"):  # SE of the seed mean of independent estimates
                    se = np.sqrt(np.sum([np.square(g[f"{pos}_diff_se"]) for g in gains], axis=0))
                    row["gain_K"][f"{pos}_diff_se"] = (se / len(gains)).round(4).tolist()
            rows.append(row)
    return rows


def report(out: Path) -> list[dict]:
    runs = read_runs(out / "synthetic_runs")
    if not runs:
        raise SystemExit(f"no runs in {out / 'synthetic_runs'}")
    # label noise (the paper's setting) and noise in the answer text itself are separate studies
    labels_only = [r for r in runs if not (r.get("noise_in_inputs") and r["noise_rate"])]
    in_inputs = [r for r in runs if r.get("noise_in_inputs") or not r["noise_rate"]]
    rows = _rows(labels_only, "synthetic_qa")
    if any(r.get("noise_in_inputs") and r["noise_rate"] for r in runs):
        # the clean runs are its references only: their rows stand once, under synthetic_qa
        rows += [r for r in _rows(in_inputs, "synthetic_qa_noisy_inputs") if r["noise"]]
    squad = _squad_cpu_runs(out)
    all_rows = rows + (_rows(squad, "squad_v1.1_cpu_988k") if squad else [])
    (out / "summary.json").write_text(json.dumps(all_rows, indent=1))
    sizes = sorted({(r["model"], r["params"]) for r in rows if r.get("params")})
    lines = [
        "# Synthetic extractive QA, noisy SFT",
        "",
        "(generated by `bench/lm_synthetic.py --stage report`)",
        "",
        "Model: " + (", ".join(f"{m}, {n:,} parameters" for m, n in sizes) or "not recorded") + ".",
        "",
        "EM/F1 on the 500 clean test questions (mean over seeds, ± SE over seeds); paired "
        "differences against `off` over the same questions and seeds (± paired SE).",
        "",
        "Noise in `labels`: only the training targets are corrupted (the paper's token-label "
        "noise); in `text`: the answer tokens themselves (input and target).",
        "",
        "| noise in | noise | k | method | seeds | EM | F1 | ΔEM vs off | ΔF1 vs off | fit s/run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    where_ = {"synthetic_qa": "labels", "synthetic_qa_noisy_inputs": "text"}
    for r in rows:
        se = f" ± {r['em_se_seeds']:.3f}" if r["em_se_seeds"] is not None else ""
        fse = f" ± {r['f1_se_seeds']:.3f}" if r["f1_se_seeds"] is not None else ""
        dl = (
            f"{r['paired_delta_em']:+.3f} ± {r['paired_se_em']:.3f}"
            if r["method"] != "off" and r["paired_delta_em"] is not None
            else ""
        )
        df = (
            f"{r['paired_delta_f1']:+.3f} ± {r['paired_se_f1']:.3f}"
            if r["method"] != "off" and r["paired_delta_f1"] is not None
            else ""
        )
        lines.append(
            f"| {where_[r['task']]} | {r['noise']:g} | {r['distractors']} | {r['method']} | "
            f"{len(r['seeds'])} | "
            f"{r['em']:.3f}{se} | {r['f1']:.3f}{fse} | {dl} | {df} | {r['fit_seconds_mean']:.0f} |"
        )
    gl = [
        "",
        "## BFT: Kalman gain K at answer positions, corrupted vs clean training labels",
        "",
        "Per layer, mean over seeds; `target`: the position that predicts the label; "
        "`token`: the position that reads the answer token.",
        "",
        "| noise in | noise | k | where | K corrupted | K clean | corrupted - clean (± SE) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g = r.get("gain_K")
        if not g:
            continue
        for pos in ("target", "token"):
            fmt = lambda v: " / ".join(f"{x:.4f}" for x in v)  # noqa: E731
            gl.append(
                f"| {where_[r['task']]} | {r['noise']:g} | {r['distractors']} | {pos} | "
                f"{fmt(g[pos + '_corrupted'])} | {fmt(g[pos + '_clean'])} | "
                + " / ".join(
                    f"{d:+.4f} ± {e:.4f}" for d, e in zip(g[pos + "_diff"], g[pos + "_diff_se"])
                )
                + " |"
            )
    (out / "synthetic_tables.md").write_text("\n".join(lines + gl) + "\n")
    print("\n".join(lines + gl))
    _figure([r for r in rows if r["task"] == "synthetic_qa"], out / "synthetic_em_vs_noise.png")
    return rows


def _figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({r["distractors"] for r in rows})
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), squeeze=False)
    for ax, k in zip(axes[0], ks):
        for m in METHODS:
            pts = sorted(
                (r["noise"], r["em"], r["em_se_seeds"] or 0.0)
                for r in rows
                if r["method"] == m and r["distractors"] == k
            )
            if pts:
                ax.errorbar(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    yerr=[p[2] for p in pts],
                    marker="o",
                    capsize=3,
                    label=m,
                )
        ax.set(
            xlabel="label-noise rate (fraction of answer tokens)",
            ylabel="test EM (clean)",
            title=f"synthetic QA, {k} distractors",
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def stop_time(text: str, now: float | None = None) -> float:
    """``--stop-at``'s Unix time: ``YYYY-MM-DDTHH:MM`` (UTC), or ``HH:MM`` (UTC) taken as
    its next occurrence from ``now``, so that a study started before midnight with a stop
    after it is not stopped at once."""
    import calendar
    import datetime as dt

    now = time.time() if now is None else now
    try:
        if "T" in text:
            moment = dt.datetime.strptime(text, "%Y-%m-%dT%H:%M")
            return float(calendar.timegm(moment.timetuple()))
        clock = dt.datetime.strptime(text, "%H:%M")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected YYYY-MM-DDTHH:MM or HH:MM (UTC)"
        ) from None
    day = dt.datetime.fromtimestamp(now, dt.UTC).replace(
        hour=clock.hour, minute=clock.minute, second=0, microsecond=0
    )
    if day.timestamp() <= now - 60:  # earlier today than now (by more than its minute)
        day += dt.timedelta(days=1)
    return day.timestamp()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/bft_lm_synth"))
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--stage", choices=("all", "pretrain", "sft", "report"), default="all")
    p.add_argument("--model", choices=sorted(MODELS), default="d128")
    p.add_argument("--pretrain-steps", type=int, default=1500)
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument(
        "--pretrain-init",
        type=Path,
        default=None,
        help="continue pretraining from this exported base",
    )
    p.add_argument(
        "--pretrain-data-seed",
        type=int,
        default=0,
        help="seed of the pretraining documents (another one when continuing)",
    )
    p.add_argument("--pretrain-recall", type=int, default=4, help="recall lines per document")
    p.add_argument("--pretrain-seq-len", type=int, default=64)
    p.add_argument(
        "--pretrain-copy-passages", type=int, default=0, help="passages restated word for word"
    )
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    p.add_argument("--distractors", type=int, nargs="+", default=[0])
    p.add_argument("--methods", nargs="+", default=["off", "bft"], choices=list(METHODS))
    p.add_argument("--noise-in-inputs", action="store_true")
    p.add_argument(
        "--value-words",
        type=int,
        default=DATA["max_value_words"],
        help="longest answer in words (the generator's max_value_words)",
    )
    p.add_argument(
        "--num-train",
        type=int,
        default=DATA["num_train"],
        help="training questions (>= sft steps x batch: each seen once)",
    )
    p.add_argument("--facts", type=int, default=DATA["facts_per_passage"], help="facts per passage")
    p.add_argument("--fact-order", default=DATA["fact_order"], choices=FACT_ORDERS)
    p.add_argument("--shard", default="0/1", help="i/n: run every n-th run from the i-th")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--accelerator", default="cpu", help="the Trainers' accelerator (cpu, gpu, auto)"
    )
    p.add_argument(
        "--stop-at", default=None, type=stop_time,
        help="start no run after this UTC time: YYYY-MM-DDTHH:MM, or HH:MM (its next "
        "occurrence, within a day of the start)",
    )  # fmt: skip
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    global ACCELERATOR
    ACCELERATOR = a.accelerator
    DATA.update(
        max_value_words=a.value_words,
        facts_per_passage=a.facts,
        num_train=a.num_train,
        fact_order=a.fact_order,
    )
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.stage in ("all", "pretrain"):
        info = pretrain(
            a.work,
            a.model,
            a.pretrain_steps,
            a.pretrain_lr,
            a.pretrain_init,
            a.pretrain_data_seed,
            a.pretrain_recall,
            a.pretrain_seq_len,
            a.pretrain_copy_passages,
        )
        print("pretrain:", {k: v for k, v in info.items() if k != "train_loss_trace"}, flush=True)
    if a.stage in ("all", "sft"):
        i, n = map(int, a.shard.split("/"))
        grid = [
            (m, x, k, s) for s in a.seeds for k in a.distractors for x in a.noise for m in a.methods
        ]
        for m, x, k, s in grid[i::n]:
            if a.stop_at is not None and time.time() >= a.stop_at:
                when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(a.stop_at))
                print(f"stopping: it is past {when} UTC", flush=True)
                break
            t0 = time.time()
            r = run_sft(a.work, a, m, x, k, s)
            print(
                f"{r['name']}: EM {r['test_em']:.3f} F1 {r['test_f1']:.3f} "
                f"(fit {r['fit_seconds']} s, total {time.time() - t0:.0f} s)",
                flush=True,
            )
    if a.stage in ("all", "report"):
        report(a.out)


if __name__ == "__main__":
    main()
