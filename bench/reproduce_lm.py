"""The CPU-sized noisy-SFT experiment of the LM half (results in ``results/lm/``).

No pretrained weights can be downloaded here, so a small Llama-style model is
pretrained from scratch and then fine-tuned, mirroring the TinyLlama protocol
(pretrained Llama -> SFT with or without BFT):

1. tokenizer: byte-level BPE (1,024 ids) trained on the SQuAD v1.1 training
   articles and Tiny Shakespeare (kept in ``--work``, not in the repository);
2. pretraining: language modelling on the training articles' passages, 6
   self-supervised cloze questions per passage (a sentence with a 1-4 word
   span blanked out, answered by the span; no QA label is used, so no clean
   SQuAD answer is ever seen) and 90% of Tiny Shakespeare; exported in Llama
   format;
3. SFT on SQuAD v1.1 (split by article: 34 train, 4 val, 10 test articles):
   SFT (cross-entropy), focal loss (gamma 2) and BFT (precision on,
   calibrated to a median gain of 0.95, cross-entropy), at label-noise rates
   ``np`` in {0, 0.2, 0.4} without distractors, and at ``np = 0`` with
   ``k`` distractor passages from other training/test articles;
4. evaluation: greedy answers on every test question, SQuAD EM/F1; on a
   fixed subset, the attention-sink mass (attention on the BOS token) and
   the mean Kalman gain per layer, by context length.

Run (about 3-4 hours on 2 shared cores; finished runs are skipped)::

    OMP_WAIT_POLICY=PASSIVE nice -n 10 python bench/reproduce_lm.py --work /tmp/bft_lm
    python bench/reproduce_lm.py --work /tmp/bft_lm --stage report

With ``--checkpoint_dir DIR`` (a local Llama-format folder, e.g. TinyLlama-1.1B:
``config.json``, ``*.safetensors``, ``tokenizer.json``) it runs the paper's
protocol instead, on CUDA when there is one: SFT of that checkpoint on SQuAD
v1.1, HotpotQA (distractor setting) and NQ-open, methods ``off`` / ``bft`` /
``focal`` / ``label_smoothing``, label noise 0 / 0.1 / 0.3, distractors
0 / 2 / 4, seeds 0 1 2, with the settings of ``configs/experiments/lm_tinyllama_*.yaml``
(lr 2e-5, tau and rho at 100x for BFT, 100 warm-up steps then cosine, 3
epochs, 8 x 4 sequences per step, bf16, clip 1.0); one JSON per run in
``<out>/checkpoint_runs/`` (finished runs are skipped) and
``<out>/checkpoint_summary.json``::

    python bench/reproduce_lm.py --checkpoint_dir /models/TinyLlama-1.1B --out results/lm/tinyllama
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pretrain as pt  # noqa: E402
from common.hardware import device_name  # noqa: E402
from common.paired import mean_se, paired_runs  # noqa: E402
from common.runs import read_runs, save_run  # noqa: E402

from bft_lightning.lm.data.qa import (  # noqa: E402
    QADataModule,
    QAPretrainDataModule,
    collate_qa,
    data_root,
)
from bft_lightning.lm.model import BFTOptions, LlamaConfig  # noqa: E402
from bft_lightning.lm.task import LanguageSFT  # noqa: E402
from bft_lightning.nn.filter import FilterConfig  # noqa: E402
from bft_lightning.nn.stats import set_recording  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
METHODS = {  # name -> (loss, precision)
    "sft": ("ce", "off"),
    "focal": ("focal", "off"),
    "bft": ("ce", "on"),
}
MODEL = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
DATA = dict(
    dataset="squad",
    val_groups=4,
    test_groups=10,
    split_seed=0,
    max_length=384,
    max_passage_tokens=64,
    max_eval_examples=1000,
    max_answer_tokens=24,
    tokenizer_vocab_size=1024,
)


def pretrain(work: Path, steps: int, root: str | None = None) -> dict[str, Any]:
    def build() -> tuple[LanguageSFT, QAPretrainDataModule]:
        shakespeare = str(data_root(root) / "tinyshakespeare" / "input.txt")
        dm = QAPretrainDataModule(
            seq_len=128,
            cloze_per_passage=6,
            extra_text_files=[shakespeare],
            cache_dir=str(work / "cache"),
            batch_size=32,
            eval_batch_size=64,
            **DATA,  # type: ignore[arg-type]
        )
        task = LanguageSFT(
            LlamaConfig(**MODEL),
            lr=2e-3,
            weight_decay=0.1,
            warmup_steps=100,
            cosine=True,
            generate=False,
            export_dir=str(work / "base"),
        )
        return task, dm

    def record(fit: pt.Fit) -> dict[str, Any]:
        return {
            "steps": steps,
            "seconds": fit.seconds,
            "train_loss_trace": fit.trace,
            "val_loss": float(fit.trainer.callback_metrics["val/loss"]),
            "train_chunks": len(fit.dm.chunks["train"]),
            "params": sum(p.numel() for p in fit.task.parameters()),
        }

    return pt.pretrain(
        work / "pretrain.json", work, steps, build, record, every=50,
        val_check_interval=500, limit_val_batches=20,
    )  # fmt: skip


@torch.no_grad()
def analyse(task: LanguageSFT, dm: QADataModule, n: int = 256, batch: int = 32) -> list[dict]:
    """Per test example: prompt length, and per layer mean gain, sink mass, mean n_eff."""
    model = task.model.eval()
    items = dm.encoded["test"][:n]
    tok = dm.load_tokenizer()
    set_recording(model, True, attention=True)
    rows = []
    for i in range(0, len(items), batch):
        part = items[i : i + batch]
        b = collate_qa(part, tok.pad_id)
        model(b["input_ids"], b["attention_mask"])
        valid = b["attention_mask"].bool()
        for j, it in enumerate(part):
            layers = []
            for layer in model.model.decoder_layers:
                st = layer.last_stats
                assert st is not None and st.attention is not None
                v = valid[j]
                att = st.attention[j][:, v][:, :, v]  # (H, n, n) valid queries x keys
                sink = float(att[:, 1:, 0].mean())  # weight on BOS, queries after it
                layers.append(
                    {
                        "gain": float(st.gain[j][v].mean()),
                        "sink": sink,
                        "n_eff": float(st.n_eff[j][v].mean()),
                    }
                )
            rows.append({"context_tokens": len(it.prompt), "layers": layers})
    set_recording(model, False)
    return rows


@torch.no_grad()
def per_question_ce(task: LanguageSFT, dm: QADataModule, batch: int = 64) -> dict[str, float]:
    """Mean cross-entropy (nats) of the clean answer tokens (and EOS) of each test question."""
    model = task.model.eval()
    tok = dm.load_tokenizer()
    items = dm.encoded["test"]
    out = {}
    for i in range(0, len(items), batch):
        b = collate_qa(items[i : i + batch], tok.pad_id)
        logp = model(b["input_ids"], b["attention_mask"]).logits.float().log_softmax(-1)
        lab = b["labels"]
        sel = lab != -100
        nll = -logp.gather(-1, lab.clamp_min(0).unsqueeze(-1)).squeeze(-1) * sel
        for qid, tot, n in zip(b["ids"], nll.sum(1).tolist(), sel.sum(1).tolist()):
            out[qid] = round(tot / n, 4)
    return out


def run_sft(
    work: Path, out: Path, method: str, noise: float, k: int, seed: int, epochs: int
) -> dict[str, Any]:
    name = f"{method}_np{noise:g}_k{k}_s{seed}"
    file = out / "runs" / f"{name}.json"
    if file.is_file():
        return json.loads(file.read_text())
    loss, precision = METHODS[method]
    L.seed_everything(seed)
    dm = QADataModule(
        tokenizer_path=str(work / "base" / "tokenizer.json"),
        num_distractors=k,
        distractor_source="other_articles",
        noise_rate=noise,
        seed=seed,
        batch_size=16,
        eval_batch_size=64,
        **DATA,  # type: ignore[arg-type]
    )
    task = LanguageSFT(
        checkpoint_dir=str(work / "base"),
        bft=BFTOptions(filter=FilterConfig(precision=precision)),
        loss=loss,
        focal_gamma=2.0,
        lr=1e-3,
        warmup_steps=50,
        cosine=True,
        max_new_tokens=24,
        target_gain=0.95,
    )
    trace = pt.LossTrace(every=50)
    t0 = time.time()
    trainer = pt.lm_trainer(work, max_epochs=epochs, callbacks=[trace], limit_val_batches=0)
    trainer.fit(task, dm)
    fit_s = time.time() - t0
    res = trainer.test(task, dm, verbose=False)[0]
    per_q = [(p["id"], *_scores(p["prediction"], p["answers"])) for p in task.predictions]
    (work / "predictions").mkdir(exist_ok=True)
    (work / "predictions" / f"{name}.json").write_text(json.dumps(task.predictions))
    result: dict[str, Any] = {
        "name": name,
        "method": method,
        "loss": loss,
        "precision": precision,
        "noise_rate": noise,
        "distractors": k,
        "seed": seed,
        "epochs": epochs,
        "train_examples": len(dm.encoded["train"]),
        "test_questions": len(per_q),
        "dropped": dm.dropped,
        "test_em": res["test/em"],
        "test_f1": res["test/f1"],
        "test_loss": res["test/loss"],
        "fit_seconds": round(fit_s),
        "train_loss_trace": trace.trace,
        "per_question": {i: [e, round(f, 4)] for i, e, f in per_q},
    }
    if precision == "on":
        rep = task.calibration_report
        result["calibration"] = {"median_gain": rep.median_gain, "log_c": rep.log_c, "q": rep.q}
        prior = task.model.model.prior
        assert prior is not None
        used = torch.tensor(sorted({t for e in dm.encoded["train"] for t in e.prompt + e.answer}))
        log_tau = prior.log_tau.weight[used].float()
        result["log_tau_std_used_ids"] = float(log_tau.std())
        result["q_final"] = [layer.process_noise().tolist() for layer in task.model.model.layers]
    result["per_question_ce"] = per_question_ce(task, dm)
    result["analysis"] = analyse(task, dm)
    return save_run(file, result)


def _scores(pred: str, golds: list[str]) -> tuple[float, float]:
    from bft_lightning.lm.metrics import qa_scores

    return qa_scores(pred, golds)


# --------------------------------------------------------------------------- report
def _question_values(run: dict, metric: str) -> dict[str, float]:
    if metric == "ce":
        return run["per_question_ce"]
    return {q: v[1] for q, v in run["per_question"].items()}


def _paired(
    runs: list[dict], a: str, b: str, noise: float, k: int, metric: str = "f1"
) -> tuple[float, float, int]:
    """Mean per-question difference a - b (F1 or answer CE), same questions and seed."""
    return paired_runs(runs, a, b, noise, k, lambda r: _question_values(r, metric))


def report(out: Path, work: Path) -> None:
    runs = read_runs(out / "runs")
    if not runs:
        raise SystemExit(f"no runs in {out / 'runs'}")
    pre = (
        json.loads((work / "pretrain.json").read_text())
        if (work / "pretrain.json").is_file()
        else None
    )
    if pre is not None:
        (out / "pretrain.json").write_text(json.dumps(pre, indent=1))
    elif (out / "pretrain.json").is_file():
        pre = json.loads((out / "pretrain.json").read_text())
    conds = sorted({(r["noise_rate"], r["distractors"]) for r in runs})
    lines = [
        "| np | k | method | seeds | EM (%) | F1 (%) | answer CE (nats/token) |",
        "|---|---|---|---|---|---|---|",
    ]
    summary: dict[str, Any] = {}
    for noise, k in conds:
        for m in METHODS:
            rs = [
                r for r in runs if (r["method"], r["noise_rate"], r["distractors"]) == (m, noise, k)
            ]
            if not rs:
                continue
            em, em_se = mean_se([100 * r["test_em"] for r in rs])
            f1, f1_se = mean_se([100 * r["test_f1"] for r in rs])
            ce, ce_se = mean_se([r["test_loss"] for r in rs])
            summary[f"{m}_np{noise:g}_k{k}"] = {
                "em": em,
                "em_se": em_se,
                "f1": f1,
                "f1_se": f1_se,
                "answer_ce": ce,
                "answer_ce_se": ce_se,
                "seeds": [r["seed"] for r in rs],
            }
            lines.append(
                f"| {noise:g} | {k} | {m} | {len(rs)} | {em:.2f} ± {em_se:.2f} | "
                f"{f1:.2f} ± {f1_se:.2f} | {ce:.3f} ± {ce_se:.3f} |"
            )
    paired = [
        "| np | k | comparison | answer CE diff (nats) | paired SE | F1 diff (pts) | paired SE "
        "| n (question x seed) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for noise, k in conds:
        for a, b in (("bft", "sft"), ("focal", "sft"), ("bft", "focal")):
            d, se, n = _paired(runs, a, b, noise, k)
            dc, sec, _ = _paired(runs, a, b, noise, k, "ce")
            if n:
                paired.append(
                    f"| {noise:g} | {k} | {a} - {b} | {dc:+.4f} | {sec:.4f} | {100 * d:+.2f} | "
                    f"{100 * se:.2f} | {n} |"
                )
    mech = _mechanism_tables(runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _figure(runs, out / "lm_noisy_sft.png")
    text = [
        "# CPU noisy-SFT experiment (generated by `bench/reproduce_lm.py --stage report`)",
        "",
        "## EM / F1 on the held-out SQuAD v1.1 test articles (mean ± SE over seeds)",
        "",
        *lines,
        "",
        "## Paired per-question differences (same questions, same seed; CE: lower is better)",
        "",
        *paired,
        "",
        *mech,
    ]
    if pre is not None:
        text += [
            "",
            f"Pretraining: {pre['steps']} steps, {pre['params']} parameters, "
            f"final val loss {pre['val_loss']:.3f} nats/token, {pre['seconds']} s.",
        ]
    (out / "tables.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))


def _bins(rows: list[dict], edges: list[int]) -> list[list[dict]]:
    return [[r for r in rows if lo <= r["context_tokens"] < hi] for lo, hi in zip(edges, edges[1:])]


def _mechanism_tables(runs: list[dict]) -> list[str]:
    """Mean gain and sink mass per layer by context length (np = 0, pooled over seeds)."""
    out = ["## Mechanism at np = 0: mean gain K and sink mass per layer, by context length", ""]
    for k in sorted({r["distractors"] for r in runs}):
        rows_all = [
            x for r in runs if r["noise_rate"] == 0 and r["distractors"] == k for x in r["analysis"]
        ]
        if not rows_all:
            continue
        lengths = sorted(x["context_tokens"] for x in rows_all)
        edges = [
            lengths[0],
            *(lengths[int(len(lengths) * q)] for q in (1 / 3, 2 / 3)),
            lengths[-1] + 1,
        ]
        out += [
            f"k = {k} distractors; context-length bins (tokens): "
            f"{', '.join(f'[{a}, {b})' for a, b in zip(edges, edges[1:]))}",
            "",
            "| method | layer | K by bin | sink mass by bin | n_eff by bin |",
            "|---|---|---|---|---|",
        ]
        for m in METHODS:
            rs = [
                x
                for r in runs
                if r["method"] == m and r["noise_rate"] == 0 and r["distractors"] == k
                for x in r["analysis"]
            ]
            if not rs:
                continue
            for layer in range(len(rs[0]["layers"])):
                cells = []
                for key in ("gain", "sink", "n_eff"):
                    vals = [
                        np.mean([x["layers"][layer][key] for x in b]) if b else float("nan")
                        for b in _bins(rs, edges)
                    ]
                    cells.append(" / ".join(f"{v:.3f}" for v in vals))
                out.append(f"| {m} | {layer} | {' | '.join(cells)} |")
        out.append("")
    return out


def _cond(runs: list[dict], m: str, noise: float, k: int, key: str, scale: float = 1.0):
    vals = [
        scale * r[key]
        for r in runs
        if (r["method"], r["noise_rate"], r["distractors"]) == (m, noise, k)
    ]
    mu, se = mean_se(vals) if vals else (float("nan"), float("nan"))
    return mu, 0.0 if math.isnan(se) else se


def _figure(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(22, 4))
    colours = {"sft": "tab:blue", "focal": "tab:orange", "bft": "tab:green"}
    noises = sorted({r["noise_rate"] for r in runs if r["distractors"] == 0})
    ks = sorted({r["distractors"] for r in runs if r["noise_rate"] == 0})
    panels = (
        (axes[0], "test_loss", 1.0, noises, "np", "answer CE, clean test labels (nats/token)"),
        (axes[1], "test_f1", 100.0, noises, "np", "test F1 (%)"),
        (axes[2], "test_loss", 1.0, ks, "k", "answer CE (nats/token)"),
    )
    for ax, key, scale, xs, var, label in panels:
        for m, c in colours.items():
            if var == "np":
                pts = [_cond(runs, m, x, 0, key, scale) for x in xs]
            else:
                pts = [_cond(runs, m, 0.0, x, key, scale) for x in xs]
            ax.errorbar(
                xs,
                [p[0] for p in pts],
                yerr=[p[1] for p in pts],
                marker="o",
                color=c,
                label=m,
                capsize=3,
            )
        xlabel = "label-noise rate np (k = 0)" if var == "np" else "distractors k (np = 0)"
        ax.set(xlabel=xlabel, ylabel=label, xticks=xs)
        ax.legend()
    rows_all = [x for r in runs if r["noise_rate"] == 0 for x in r["analysis"]]
    if rows_all:
        edges = np.quantile([x["context_tokens"] for x in rows_all], np.linspace(0, 1, 7))
        mids = (edges[:-1] + edges[1:]) / 2
        for m, c in colours.items():
            rows = [
                x for r in runs if r["method"] == m and r["noise_rate"] == 0 for x in r["analysis"]
            ]
            if not rows:
                continue
            xs_ = np.array([x["context_tokens"] for x in rows])
            last = len(rows[0]["layers"]) - 1
            idx = np.clip(np.searchsorted(edges, xs_, side="right") - 1, 0, len(mids) - 1)
            series = [
                (axes[4], "sink", last, "-", "last layer"),
                (axes[4], "sink", 0, ":", "layer 0"),
            ]
            if m == "bft":
                series += [
                    (axes[3], "gain", 0, ":", "layer 0"),
                    (axes[3], "gain", last, "-", "last layer"),
                ]
            for ax, key, layer, style, what in series:
                ys = np.array([x["layers"][layer][key] for x in rows])
                means = [
                    ys[idx == b].mean() if (idx == b).any() else np.nan for b in range(len(mids))
                ]
                ax.plot(mids, means, style, marker=".", color=c, label=f"{m}, {what}")
        axes[3].set(xlabel="context length (tokens; np = 0, all k)", ylabel="mean Kalman gain K")
        axes[4].set(xlabel="context length (tokens; np = 0, all k)", ylabel="attention mass on BOS")
        axes[3].legend(fontsize=7)
        axes[4].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------- the protocol on a checkpoint
# The paper's SFT of a pretrained Llama (TinyLlama-1.1B): the settings of
# configs/experiments/lm_tinyllama_*.yaml (lr 2e-5, tau/rho at 100x, 100 warm-up
# steps then cosine, 3 epochs, 32 sequences per step as 8 x 4, bf16, clip 1.0).
CKPT_DATA: dict[str, dict[str, Any]] = {
    "squad": dict(
        dataset="squad", val_groups=4, test_groups=10, distractor_source="other_articles"
    ),
    "hotpotqa": dict(
        dataset="hotpotqa", val_groups=0.1, test_groups=0.3, distractor_source="dataset"
    ),
    "nq": dict(dataset="nq", val_groups=0.05, test_groups=0.2, distractor_source="other_articles"),
}
CKPT_METHODS: dict[str, dict[str, Any]] = {
    "off": dict(loss="ce", precision="off"),
    "bft": dict(loss="ce", precision="on", prior_lr_scale=100.0, gradient_checkpointing=True),
    "focal": dict(loss="focal", precision="off"),
    "label_smoothing": dict(loss="ce", precision="off", label_smoothing=0.1),
}


def checkpoint_run(
    a: argparse.Namespace, dataset: str, method: str, noise: float, k: int, seed: int
) -> dict[str, Any]:
    """One SFT run of the checkpoint in ``a.checkpoint_dir``; skipped when its file exists."""
    name = f"{dataset}_{method}_np{noise:g}_k{k}_s{seed}"
    file = a.out / "checkpoint_runs" / f"{name}.json"
    if file.is_file():
        return json.loads(file.read_text()) | {"skipped": True}
    opts = dict(CKPT_METHODS[method])
    precision = opts.pop("precision")
    L.seed_everything(seed)
    dm = QADataModule(
        tokenizer_path=str(a.checkpoint_dir),
        num_distractors=k,
        noise_rate=noise,
        seed=seed,
        split_seed=0,
        max_length=a.max_length,
        max_answer_tokens=32,
        max_train_examples=a.max_train_examples,
        max_eval_examples=a.max_eval_examples,
        batch_size=a.batch_size,
        eval_batch_size=a.eval_batch_size,
        data_root=a.data_root,
        **CKPT_DATA[dataset],
    )
    task = LanguageSFT(
        checkpoint_dir=str(a.checkpoint_dir),
        bft=BFTOptions(filter=FilterConfig(precision=precision)),
        lr=a.lr,
        warmup_steps=a.warmup_steps,
        cosine=True,
        max_new_tokens=32,
        target_gain=0.95,
        **opts,
    )
    trace = pt.LossTrace(every=a.log_every)
    cuda = torch.cuda.is_available() and a.accelerator != "cpu"
    t0 = time.time()
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_epochs=a.ckpt_epochs,
        max_steps=a.max_steps,
        accumulate_grad_batches=a.accumulate,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[trace],
        default_root_dir=a.work,
    )
    trainer.fit(task, dm)
    fit_s = time.time() - t0
    res = trainer.test(task, dm, verbose=False)[0]
    per_q = {
        p["id"]: [round(v, 4) for v in _scores(p["prediction"], p["answers"])]
        for p in task.predictions
    }
    out = {
        "name": name,
        "dataset": dataset,
        "method": method,
        "noise_rate": noise,
        "distractors": k,
        "seed": seed,
        "checkpoint_dir": str(a.checkpoint_dir),
        "device": device_name("cuda:0") if cuda else "cpu",
        "test_em": res["test/em"],
        "test_f1": res["test/f1"],
        "test_loss": res["test/loss"],
        "train_examples": len(dm.encoded["train"]),
        "steps": trainer.global_step,
        "fit_seconds": round(fit_s, 1),
        "train_loss_trace": trace.trace,
        "per_question": per_q,
    }
    return save_run(file, out)


def checkpoint_protocol(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every dataset x method x noise x distractors x seed on the checkpoint, then a summary."""
    rows = []
    for d in a.datasets:
        for s in a.seeds:
            for n in a.noise:
                for k in a.ckpt_distractors:
                    for m in a.methods:
                        r = checkpoint_run(a, d, m, n, k, s)
                        print(
                            f"{r['name']}: EM {r['test_em']:.3f} F1 {r['test_f1']:.3f} "
                            f"({r['fit_seconds']} s fit)",
                            flush=True,
                        )
                        rows.append(r)
    summary = [
        {k: v for k, v in r.items() if k not in ("per_question", "train_loss_trace")} for r in rows
    ]
    (a.out / "checkpoint_summary.json").write_text(json.dumps(summary, indent=1))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/bft_lm"))
    p.add_argument("--out", type=Path, default=REPO / "results" / "lm")
    p.add_argument("--stage", choices=("all", "pretrain", "sft", "report"), default="all")
    p.add_argument("--pretrain-steps", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.2, 0.4])
    p.add_argument("--distractors", type=int, default=2)
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--threads", type=int, default=2)
    g = p.add_argument_group("the protocol on a local Llama-format checkpoint (GPU)")
    g.add_argument(
        "--checkpoint_dir",
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="a local Llama-format folder (config.json, *.safetensors, tokenizer.json):"
        " runs SFT on --datasets with the paper's settings and writes "
        "<out>/checkpoint_runs/ and <out>/checkpoint_summary.json",
    )
    g.add_argument(
        "--datasets", nargs="+", default=["squad", "hotpotqa", "nq"], choices=sorted(CKPT_DATA)
    )
    g.add_argument("--ckpt-distractors", type=int, nargs="+", default=[0, 2, 4])
    g.add_argument("--ckpt-epochs", type=int, default=3)
    g.add_argument("--max-steps", type=int, default=-1, help="optimizer steps cap (-1: epochs)")
    g.add_argument("--lr", type=float, default=2e-5)
    g.add_argument("--warmup-steps", type=int, default=100)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--accumulate", type=int, default=4)
    g.add_argument("--eval-batch-size", type=int, default=32)
    g.add_argument("--max-length", type=int, default=1024)
    g.add_argument("--max-train-examples", type=int, default=None)
    g.add_argument("--max-eval-examples", type=int, default=None)
    g.add_argument("--data-root", default=None)
    g.add_argument("--accelerator", choices=("auto", "cpu"), default="auto")
    g.add_argument("--log-every", type=int, default=20)
    a = p.parse_args(argv)
    # the benchmarks read the shared data sets next to the repository unless told otherwise
    shared = str(REPO.parent / "shared" / "data")
    a.data_root = a.data_root or os.environ.get("BFT_DATA_ROOT", shared)
    torch.set_num_threads(a.threads)
    if a.checkpoint_dir is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        a.work.mkdir(parents=True, exist_ok=True)
        if a.methods == list(METHODS):  # the CPU protocol's default: take the paper's four
            a.methods = list(CKPT_METHODS)
        if a.noise == [0.0, 0.2, 0.4]:  # the paper's rates, 3 seeds
            a.noise = [0.0, 0.1, 0.3]
        if a.seeds == [0, 1]:
            a.seeds = [0, 1, 2]
        bad = [m for m in a.methods if m not in CKPT_METHODS]
        if bad:
            raise SystemExit(f"--methods {bad}: with --checkpoint_dir use {list(CKPT_METHODS)}")
        checkpoint_protocol(a)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.stage in ("all", "pretrain"):
        print(
            "pretrain:",
            {
                k: v
                for k, v in pretrain(a.work, a.pretrain_steps, a.data_root).items()
                if k != "train_loss_trace"
            },
        )
    if a.stage in ("all", "sft"):
        grid = []  # seed by seed, the most informative conditions first
        for s in a.seeds:
            for n in sorted(a.noise, key=lambda x: (x != 0, -x)):
                grid += [(m, n, 0, s) for m in a.methods]
            grid += [(m, 0.0, a.distractors, s) for m in a.methods] if a.distractors else []
        for m, n, k, s in grid:
            t0 = time.time()
            r = run_sft(a.work, a.out, m, n, k, s, a.epochs)
            print(
                f"{r['name']}: EM {100 * r['test_em']:.2f} F1 {100 * r['test_f1']:.2f} "
                f"({time.time() - t0:.0f} s)",
                flush=True,
            )
    if a.stage in ("all", "report"):
        report(a.out, a.work)


if __name__ == "__main__":
    main()
