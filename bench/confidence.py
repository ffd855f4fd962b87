"""Does a list's confidence predict a hit? Every signal, every model, one table.

For each trained checkpoint (``--run dataset/backbone/variant=PATH``), runs the
DataModule's validation and test users (leave-one-out: the last item held out
for test, the one before it for validation; the task's evaluation input, full
ranking over all items, no history masking) and computes, per user, whether
the target is in the top 10 and a set of confidence signals:

- baselines every model has: the top-10 softmax mass, the top-1 probability,
  minus the entropy of the full softmax, the score margin between ranks 1 and
  11, the history length, the training popularity of the last item, and
  list-distribution uncertainty in the manner of LiDu (arXiv 2507.23208): the
  probability that the model produces its top-10 list, both as the softmax's
  own Plackett-Luce probability (``lidu_pl``) and as the chain of pairwise
  orderings under Gaussian item scores from Monte-Carlo dropout
  (``lidu_mc``);
- for ``precision="on"`` models, the filter's state at the predicting position:
  the final log precision, the Kalman gain, the last layer's observation
  precision and effective sample size, the predictive standard deviation of
  the top score, the precision-scaled margin (z-score) and LiDu with the
  filter's own score variances (each also with the final LayerNorm's
  per-user scale ``sigma(h)``, captured by a hook);
- combinations: a logistic model on the softmax mass plus one other signal,
  fit on validation users.

Each signal's direction is chosen on validation users (so that its
validation AUROC is >= 0.5); every number reported is on test users.
Writes ``<out>.json`` (rows ``{dataset, backbone, variant, signal,
auroc_hit10, n_users, hr10_by_decile}``), ``<out>.md`` and ``<out>.png``.
Per-model signals are cached in ``--cache`` (a rerun only re-analyses).

Example (the command behind ``results/rec/confidence.md``)::

    OMP_NUM_THREADS=1 python bench/confidence.py \\
        --run beauty/sasrec/off=RUNS/sasrec_off_beauty/tb/version_0/checkpoints/best.ckpt \\
        --run beauty/sasrec/on=RUNS/sasrec_on_beauty/tb/version_0/checkpoints/best.ckpt ...
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from bft_lightning.cli import main as cli_main
from bft_lightning.datamodules.recommendation import collate_arrays
from bft_lightning.metrics.confidence import auroc, hit_rate_by_decile
from bft_lightning.metrics.report import write_text_atomic
from bft_lightning.nn.stats import find_filter_layers, set_recording
from bft_lightning.retrieval import TopK
from bft_lightning.serving.confidence import (
    final_log_precision,
    gaussian_list_log_prob,
    last_position_gain,
    plackett_luce_log_prob,
    precision_z_margin,
    recommendation_confidence,
    score_variance,
    softmax_mass,
)
from bft_lightning.serving.hit_calibration import (
    BASE_FEATURES,
    confidence_features,
    feature_names,
    fit_calibration,
)
from bft_lightning.tasks.recommendation import trim_left_padding

ROOT = Path(__file__).resolve().parents[1]
DATASETS = {"beauty": "beauty", "sports": "sports"}
BASELINES = ("softmax_top10", "softmax_top1", "neg_entropy", "margin_1_11", "history_len",
             "last_item_pop", "lidu_pl", "lidu_mc")  # fmt: skip
BFT = ("bft_log_prec", "bft_log_prec_sigma", "bft_gain", "bft_gain_last", "bft_log_prec_obs",
       "bft_n_eff", "bft_neg_score_std", "bft_neg_score_std_sigma", "bft_z_margin",
       "bft_z_margin_sigma", "bft_lidu", "bft_lidu_sigma", "shipped")  # fmt: skip


def load(spec: str, data_root: str) -> tuple[str, str, str, nn.Module, object]:
    """``dataset/backbone/variant=PATH`` -> names, the task (weights loaded), the DataModule."""
    name, _, path = spec.partition("=")
    parts = name.split("/")
    if len(parts) != 3 or not path:
        raise SystemExit(f"--run {spec!r}: expected dataset/backbone/variant=CHECKPOINT")
    dataset, backbone, variant = parts
    config = ROOT / "configs" / "experiments" / f"{backbone}_{variant}_{dataset}.yaml"
    if not config.exists():
        raise SystemExit(f"--run {spec!r}: no config {config}")
    if not Path(path).exists():
        raise SystemExit(f"--run {spec!r}: no checkpoint {path}")
    cli = cli_main(["--config", str(config), f"--data.init_args.data_root={data_root}",
                    "--trainer.logger=false", "--trainer.enable_progress_bar=false"],
                   run=False)  # fmt: skip
    task = cli.model
    state = torch.load(path, map_location="cpu", weights_only=True)
    task.check_checkpoint(state, path)
    task.load_state_dict(state["state_dict"])
    task.eval()
    return dataset, backbone, variant, task, cli.datamodule


class _NormScale:
    """Forward pre-hook on the final LayerNorm: its input's std at the last position."""

    def __init__(self, norm: nn.LayerNorm) -> None:
        self.sigma: Tensor | None = None
        self.eps = norm.eps
        self.handle = norm.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: tuple[Tensor, ...]) -> None:
        h = args[0][:, -1].float()
        self.sigma = (h.var(-1, unbiased=False) + self.eps).sqrt()


def _dropout_on(model: nn.Module, on: bool) -> None:
    """Monte-Carlo dropout: only the ``nn.Dropout`` modules (the running sills stay frozen)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.train(on)


@torch.no_grad()
def signals(task: nn.Module, loader: object, freq: Tensor, mc: int) -> dict[str, np.ndarray]:
    """Per-user hit@10 and every signal over one split's loader."""
    model = task.model  # type: ignore[attr-defined]
    on = model.precision == "on"
    hook = _NormScale(model.final_norm)
    out: dict[str, list[Tensor]] = {}
    gen = torch.Generator().manual_seed(0)

    def put(key: str, value: Tensor) -> None:
        out.setdefault(key, []).append(value.detach().float().cpu())

    for batch in loader:  # type: ignore[attr-defined]
        batch = trim_left_padding(batch, keep_one=True)
        ids, times, target = batch["input_ids"], batch.get("input_time"), batch["target"]
        set_recording(model, on)
        hidden, lp, scale = model.last_encoded(ids, times)
        sigma = hook.sigma
        assert sigma is not None
        layers = [layer for _, layer in find_filter_layers(model) if layer.last_stats is not None]
        scores = model.score(hidden, lp).float()  # (B, num_items + 1), column 0 = -inf
        s_t = scores.gather(1, target.unsqueeze(1))
        ahead = (scores >= s_t).sum(1) - 1  # ties count against the target
        put("hit10", (ahead < 10).float())
        put("rank", ahead.float())
        lse = torch.logsumexp(scores, 1)
        v11, i11 = torch.topk(scores, 11, dim=1)
        top11 = TopK(scores=v11, ids=i11, logsumexp=lse)
        top10 = TopK(scores=v11[:, :10], ids=i11[:, :10], logsumexp=lse)
        logp = scores - lse.unsqueeze(1)
        p = logp.exp()
        put("softmax_top10", softmax_mass(top10))
        put("softmax_top1", (v11[:, 0] - lse).exp())
        put("neg_entropy", (p * logp.nan_to_num(0.0, neginf=0.0)).sum(1))
        put("margin_1_11", v11[:, 0] - v11[:, 10])
        put("history_len", batch["history_len"].float())
        put("last_item_pop", torch.log1p(freq[ids[:, -1]].float()))
        put("lidu_pl", plackett_luce_log_prob(top10))
        put("shipped", recommendation_confidence(model, hidden, lp, top10, scale))
        # the library's calibration features (what `calibrate` fits and `recommend` applies)
        log_count = torch.log1p(freq.float())
        put("calibration_features", confidence_features(
            model, lp, top11, 10, (ids > 0).sum(1), ids[:, -1], log_count, scale))  # fmt: skip
        if on:
            assert lp is not None
            put("bft_log_prec", final_log_precision(lp))
            put("bft_log_prec_sigma", final_log_precision(lp) + 2 * sigma.log())
            gain = last_position_gain(model)
            assert gain is not None
            put("bft_gain", gain)
            last = layers[-1].last_stats
            assert last is not None
            put("bft_gain_last", last.gain[:, -1].mean(-1))
            put("bft_log_prec_obs", last.log_prec_obs[:, -1].clamp(-20, 20).mean(-1))
            put("bft_n_eff", last.n_eff[:, -1].mean(-1))
            var = score_variance(model, lp, i11)  # (B, 11), without 1 / sigma^2
            var_s = var / sigma.square().unsqueeze(1)
            put("bft_neg_score_std", -var[:, 0].sqrt())
            put("bft_neg_score_std_sigma", -var_s[:, 0].sqrt())
            put("bft_z_margin", precision_z_margin(model, lp, top11))
            gap = v11[:, 0] - v11[:, 10]
            put("bft_z_margin_sigma", gap / (var_s[:, 0] + var_s[:, 10]).sqrt())
            put("bft_lidu", gaussian_list_log_prob(v11, var))
            put("bft_lidu_sigma", gaussian_list_log_prob(v11, var_s))
        set_recording(model, False)
        # Monte-Carlo dropout: the top-11 items' scores under mc dropout masks
        if mc > 1:
            _dropout_on(model, True)
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            draws = []
            for _ in range(mc):
                h_s, lp_s = model.last_hidden(ids, times)
                draws.append(model.score(h_s, lp_s, items=i11).float())
            _dropout_on(model, False)
            d = torch.stack(draws)  # (S, B, 11)
            put("lidu_mc", gaussian_list_log_prob(d.mean(0), d.var(0)))
    hook.handle.remove()
    return {k: torch.cat(v).numpy() for k, v in out.items()}


# -- analysis -------------------------------------------------------------------------


def _logit(p: np.ndarray) -> np.ndarray:
    q = np.clip(p, 1e-7, 1 - 1e-7)
    return np.log(q) - np.log1p(-q)


def _features(sig: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    cols = [_logit(sig[n]) if n.startswith("softmax") else sig[n] for n in names]
    if "history_len" in names:
        cols[names.index("history_len")] = np.log1p(sig["history_len"])
    return np.stack(cols, 1).astype(np.float64)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-3) -> tuple[np.ndarray, ...]:
    """Logistic regression by Newton's method on standardised features: (mean, std, w, b)."""
    mu, sd = x.mean(0), x.std(0) + 1e-12
    z = (x - mu) / sd
    a = np.concatenate([z, np.ones((len(z), 1))], 1)
    w = np.zeros(a.shape[1])
    for _ in range(50):
        p = 1 / (1 + np.exp(-(a @ w)))
        g = a.T @ (p - y) / len(y) + l2 * np.r_[w[:-1], 0]
        h = (a * (p * (1 - p))[:, None]).T @ a / len(y) + l2 * np.eye(len(w))
        step = np.linalg.solve(h, g)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return mu, sd, w[:-1], w[-1:]


def predict_logistic(model: tuple[np.ndarray, ...], x: np.ndarray) -> np.ndarray:
    mu, sd, w, b = model
    return ((x - mu) / sd) @ w + b[0]


def _auc(conf: np.ndarray, hit: np.ndarray) -> float:
    return auroc(torch.from_numpy(np.asarray(conf, dtype=np.float64)), torch.from_numpy(hit))


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing their mean rank."""
    order = np.argsort(x, kind="stable")
    sx = x[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sx)) + 1]
    ends = np.r_[starts[1:], len(x)]
    mean = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(len(x))
    ranks[order] = np.repeat(mean, ends - starts)
    return ranks


def _delong_parts(conf: np.ndarray, hit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeLong's structural components: per hit, the share of misses it beats (V10);
    per miss, the share of hits that beat it (V01); ties count one half."""
    pos, neg = conf[hit], conf[~hit]
    m, n = len(pos), len(neg)
    all_ranks = _midranks(np.r_[pos, neg])
    v10 = (all_ranks[:m] - _midranks(pos)) / n
    v01 = 1.0 - (all_ranks[m:] - _midranks(neg)) / m
    return v10, v01


def _delong_se(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Standard error of AUROC(a) - AUROC(b) on the same users (DeLong et al., 1988)."""
    d10, d01 = a[0] - b[0], a[1] - b[1]
    var = d10.var(ddof=1) / len(d10) + d01.var(ddof=1) / len(d01)
    return float(np.sqrt(max(var, 0.0)))


def analyse(val: dict, test: dict) -> dict:
    """Oriented test AUROC and HR@10 deciles of every signal and combination."""
    yv, yt = val["hit10"].astype(bool), test["hit10"].astype(bool)
    names = [n for n in (*BASELINES, *BFT) if n in test and n in val]
    conf: dict[str, np.ndarray] = {}
    val_auc: dict[str, float] = {}
    for n in names:
        a = _auc(val[n], yv)
        sign = 1.0 if a >= 0.5 else -1.0
        conf[n], val_auc[n] = sign * test[n], max(a, 1 - a)
    combos = {"softmax+history_len": ["softmax_top10", "history_len"],
              "softmax+baselines": [b for b in BASELINES if b in test]}  # fmt: skip
    for n in names:
        if n.startswith("bft_"):
            combos[f"softmax+{n}"] = ["softmax_top10", n]
    bft_names = [n for n in names if n.startswith("bft_")]
    if bft_names:
        combos["softmax+baselines+bft"] = combos["softmax+baselines"] + bft_names
    for label, cols in combos.items():
        model = fit_logistic(_features(val, cols), yv.astype(np.float64))
        conf[label] = predict_logistic(model, _features(test, cols))
        val_auc[label] = _auc(predict_logistic(model, _features(val, cols)), yv)  # in-sample
    # the shipped calibrated confidence (serving.hit_calibration), fit on validation users; for
    # precision=on also without the filter's two features, to see what they add
    if "calibration_features" in val and "calibration_features" in test:
        on = "bft_log_prec" in test
        xv, xt = val["calibration_features"], test["calibration_features"]
        all_names = feature_names("on" if on else "off")
        variants = {"calibrated": len(all_names)}
        if on:
            variants["calibrated_without_filter"] = len(BASE_FEATURES)
        for label, f in variants.items():
            cal = fit_calibration(torch.from_numpy(xv[:, :f]), torch.from_numpy(yv.astype(
                np.float64)), all_names[:f], 10)  # fmt: skip
            conf[label] = cal.probability(torch.from_numpy(xt[:, :f])).double().numpy()
            val_auc[label] = cal.auroc
    result = {n: {"auroc": _auc(c, yt), "deciles": hit_rate_by_decile(torch.from_numpy(c),
              torch.from_numpy(yt.astype(np.float64)))} for n, c in conf.items()}  # fmt: skip
    # DeLong's paired SE of each signal's AUROC minus softmax_top10's and minus the
    # best single baseline's (over the same test users)
    base = {n: result[n]["auroc"] for n in BASELINES if n in result}
    best = max(base, key=base.get)  # type: ignore[arg-type]
    parts = {n: _delong_parts(c, yt) for n, c in conf.items()}
    for n in conf:
        for ref, key in (("softmax_top10", "se_vs_softmax"), (best, "se_vs_best")):
            result[n][key] = _delong_se(parts[n], parts[ref])
        result[n]["val_auroc"] = val_auc[n]
    if "calibrated_without_filter" in conf:
        result["calibrated"]["se_vs_without_filter"] = _delong_se(
            parts["calibrated"], parts["calibrated_without_filter"])  # fmt: skip
    return {"signals": result, "best_baseline": best, "n_users": int(len(yt)),
            "hr10": float(yt.mean())}  # fmt: skip


# -- report ---------------------------------------------------------------------------


def write_outputs(
    models: list[dict], out: Path, commands: list[str], notes: str = "", merge: bool = False
) -> None:
    """``<out>.json``, ``.md`` and ``.png``. ``merge``: the models already in ``<out>`` stay
    (their rows, sections, verdicts and commands); a model analysed again replaces its rows."""
    rows = []
    for m in models:
        for n, r in m["analysis"]["signals"].items():
            rows.append({"dataset": m["dataset"], "backbone": m["backbone"],
                         "variant": m["variant"], "signal": n,
                         "auroc_hit10": round(r["auroc"], 4), "n_users": m["analysis"]["n_users"],
                         "hr10_by_decile": [round(x, 4) for x in r["deciles"]]})  # fmt: skip
    text = report(models, commands, notes)
    if merge and out.with_suffix(".json").exists():
        new = {(m["dataset"], m["backbone"], m["variant"]) for m in models}
        kept = [r for r in json.loads(out.with_suffix(".json").read_text())
                if (r["dataset"], r["backbone"], r["variant"]) not in new]  # fmt: skip
        rows = kept + rows
        text = merge_reports(out.with_suffix(".md").read_text(), text)
        models = models_from_rows(rows)
    write_text_atomic(out.with_suffix(".json"), json.dumps(rows, indent=1))
    write_text_atomic(out.with_suffix(".md"), text)
    plot(models, out.with_suffix(".png"))


def models_from_rows(rows: list[dict]) -> list[dict]:
    """The plot's input (each model's signals: AUROC and deciles) from ``<out>.json`` rows."""
    models: dict[tuple, dict] = {}
    for r in rows:
        key = (r["dataset"], r["backbone"], r["variant"])
        m = models.setdefault(key, {"dataset": key[0], "backbone": key[1], "variant": key[2],
                                    "analysis": {"signals": {}}})  # fmt: skip
        m["analysis"]["signals"][r["signal"]] = {
            "auroc": r["auroc_hit10"],
            "deciles": r["hr10_by_decile"],
        }
    return list(models.values())


def merge_reports(old: str, new: str) -> str:
    """``old`` with ``new``'s model sections before its verdicts, ``new``'s verdicts after
    its verdicts, and ``new``'s evaluation command after its commands."""

    def parts(text: str) -> tuple[str, str, str]:
        head, rest = text.split("\n## Verdict (per model)\n", 1)
        verdicts, rest = rest.split("\n## Commands\n", 1)
        return head, verdicts.strip("\n"), rest

    o_head, o_verdicts, o_rest = parts(old)
    n_head, n_verdicts, n_rest = parts(new)
    sections = n_head.split("\n## ", 1)[1]  # the new models' sections, after the preamble
    command = n_rest.split("```", 2)[1].strip("\n")
    o_rest = o_rest.replace("```", "```\n" + command, 1) if "```" in o_rest else o_rest
    return (f"{o_head.rstrip()}\n\n## {sections.rstrip()}\n\n## Verdict (per model)\n\n"
            f"{o_verdicts}\n{n_verdicts}\n\n## Commands\n{o_rest}")  # fmt: skip


def report(models: list[dict], commands: list[str], notes: str = "") -> str:
    lines = ["# Confidence that predicts a hit: AUROC for \"the target is in the top 10\"", "",
             "Test users of each model (leave-one-out, full ranking, no history masking). "
             "Each signal's direction and each combination's logistic weights were chosen "
             "on validation users; every number below is on test users. "
             "Δ columns: AUROC minus that of the top-10 softmax mass and of the best single "
             "baseline signal of the same model (chosen on test: the strictest bar), "
             "± DeLong's paired SE over the same test users.", ""]  # fmt: skip
    for m in models:
        a = m["analysis"]
        sig = a["signals"]
        best = a["best_baseline"]
        lines += [f"## {m['dataset']} / {m['backbone']} / precision={m['variant']}", "",
                  f"{a['n_users']} test users, HR@10 {a['hr10']:.4f}; checkpoint "
                  f"`{m['checkpoint']}`; best single baseline: `{best}` "
                  f"({sig[best]['auroc']:.4f}).", "",
                  "| signal | AUROC | Δ vs softmax_top10 (SE) | Δ vs best baseline (SE) | "
                  "HR@10 lowest / highest decile | val AUROC |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for n, r in sig.items():
            ds = r["auroc"] - sig["softmax_top10"]["auroc"]
            db = r["auroc"] - sig[best]["auroc"]
            lines.append(
                f"| {n} | {r['auroc']:.4f} | {ds:+.4f} ({r['se_vs_softmax']:.4f}) | "
                f"{db:+.4f} ({r['se_vs_best']:.4f}) | {r['deciles'][0]:.4f} / "
                f"{r['deciles'][-1]:.4f} | {r['val_auroc']:.4f} |"
            )
        lines.append("")
    lines += ["## Verdict (per model)", ""]
    for m in models:
        lines.append(f"- {m['dataset']}/{m['backbone']}/{m['variant']}: {verdict(m['analysis'])}")
    lines += ["", "## Commands", "", "Evaluation:", "", "```", *commands, "```", "", notes, ""]
    return "\n".join(lines)


def verdict(a: dict) -> str:
    sig, best = a["signals"], a["best_baseline"]
    bft = {n: r for n, r in sig.items() if n.startswith("bft_")}
    cal = ""
    if "calibrated" in sig:
        d = sig["calibrated"]["auroc"] - sig["softmax_top10"]["auroc"]
        cal = (f"; shipped calibrated confidence {sig['calibrated']['auroc']:.4f}, {d:+.4f} over "
               f"softmax alone (SE {sig['calibrated']['se_vs_softmax']:.4f})")  # fmt: skip
        if "calibrated_without_filter" in sig:
            w = sig["calibrated"]["auroc"] - sig["calibrated_without_filter"]["auroc"]
            se = sig["calibrated"].get("se_vs_without_filter", float("nan"))
            cal += f", of which the filter's features {w:+.4f} (SE {se:.4f})"
    if not bft:
        return (f"no filter state (precision=off); best baseline `{best}` "
                f"{sig[best]['auroc']:.4f}" + cal)  # fmt: skip
    top = max(bft, key=lambda n: bft[n]["auroc"])
    single = bft[top]["auroc"] - sig[best]["auroc"]
    combos = {n: r for n, r in sig.items() if n.startswith("softmax+bft_")}
    ctop = max(combos, key=lambda n: combos[n]["auroc"])
    gain = combos[ctop]["auroc"] - sig["softmax_top10"]["auroc"]
    control = sig["softmax+history_len"]["auroc"] - sig["softmax_top10"]["auroc"]
    return (f"best BFT signal `{top}` {bft[top]['auroc']:.4f}, {single:+.4f} against the best "
            f"baseline `{best}` (goal +0.02: {'met' if single >= 0.02 else 'not met'}); best "
            f"combination `{ctop}` {gain:+.4f} over softmax alone "
            f"(SE {combos[ctop]['se_vs_softmax']:.4f}; control softmax+history_len "
            f"{control:+.4f})" + cal)  # fmt: skip


def plot(models: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(models)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    shown = ["softmax_top10", "margin_1_11", "history_len", "last_item_pop", "lidu_pl",
             "lidu_mc", "bft_log_prec", "bft_gain", "bft_z_margin", "bft_lidu", "shipped",
             "softmax+baselines", "calibrated", "calibrated_without_filter"]  # fmt: skip
    for ax, m in zip(axes.flat, models, strict=False):
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
        sig = m["analysis"]["signals"]
        for name in shown:
            if name in sig:
                style = "-" if name.startswith(("bft", "shipped", "calibrated")) else "--"
                ax.plot(range(1, 11), sig[name]["deciles"], style, marker=".",
                        label=f"{name} ({sig[name]['auroc']:.3f})")  # fmt: skip
        ax.set_title(f"{m['dataset']} {m['backbone']} {m['variant']}", fontsize=9)
        ax.set_xlabel("confidence decile (1 = lowest)", fontsize=8)
        ax.set_ylabel("HR@10", fontsize=8)
        ax.legend(fontsize=5.5)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("HR@10 by confidence decile (test users; AUROC in the legend)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True,
                    help="dataset/backbone/variant=CHECKPOINT (repeat)")  # fmt: skip
    ap.add_argument("--data-root", default="../shared/data")
    ap.add_argument("--out", default=str(ROOT / "results" / "rec" / "confidence"))
    ap.add_argument("--cache", default=None, help="folder for per-model signals (.npz)")
    ap.add_argument("--mc", type=int, default=8, help="Monte-Carlo dropout passes (lidu_mc)")
    ap.add_argument(
        "--notes",
        default=None,
        help="a Markdown file put in the report (how the checkpoints were trained)",
    )
    ap.add_argument(
        "--val-users",
        type=int,
        default=4096,
        help="validation users (a fixed random sample; 0 = all)",
    )
    ap.add_argument("--test-users", type=int, default=0,
                    help="test users (a fixed random sample; 0 = all)")  # fmt: skip
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the other models already in --out (add or replace these)",
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    models = []
    for spec in args.run:
        name, _, path = spec.partition("=")
        cache = Path(args.cache) / (name.replace("/", "_") + ".npz") if args.cache else None
        if cache is not None and cache.exists() and "val_calibration_features" in np.load(cache):
            saved = np.load(cache)
            val = {k[4:]: saved[k] for k in saved.files if k.startswith("val_")}
            test = {k[5:]: saved[k] for k in saved.files if k.startswith("test_")}
        else:
            dataset, backbone, variant, task, dm = load(spec, args.data_root)
            freq = dm.item_frequency  # type: ignore[attr-defined]
            splits = {}
            for split, limit in (("val", args.val_users), ("test", args.test_users)):
                data = dm._dataset(split)  # type: ignore[attr-defined]
                splits[split] = signals(task, _batches(data, limit), freq, args.mc)
            val, test = splits["val"], splits["test"]
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                np.savez(cache, **{f"val_{k}": v for k, v in val.items()},
                         **{f"test_{k}": v for k, v in test.items()})  # fmt: skip
        dataset, backbone, variant = name.split("/")
        a = analyse(val, test)
        models.append({"dataset": dataset, "backbone": backbone, "variant": variant,
                       "checkpoint": path, "analysis": a})  # fmt: skip
        print(f"{name}: HR@10 {a['hr10']:.4f}; " + verdict(a), flush=True)
    command = "OMP_NUM_THREADS=1 python bench/confidence.py " + " ".join(sys.argv[1:])
    notes = Path(args.notes).read_text() if args.notes else ""
    write_outputs(models, Path(args.out), [command], notes, merge=args.merge)


def _batches(data: object, limit: int, size: int = 512, seed: int = 0) -> list[dict]:
    """Batches of a fixed random sample of ``limit`` rows (all with 0), ordered by
    history length so that each batch is trimmed to its longest history."""
    arrays = data.arrays  # type: ignore[attr-defined]
    n = len(arrays["target"])
    rows = np.arange(n)
    if 0 < limit < n:
        rows = np.sort(np.random.default_rng(seed).choice(n, limit, replace=False))
    length = (arrays["input_ids"][rows] != 0).sum(1)
    rows = rows[np.argsort(length, kind="stable")]
    return [collate_arrays({k: v[part] for k, v in arrays.items()})
            for part in np.array_split(rows, max(1, math.ceil(len(rows) / size)))]  # fmt: skip


if __name__ == "__main__":
    main()
