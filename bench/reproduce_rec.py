"""Paired off-vs-on comparison of a backbone on one dataset, over seeds.

For each seed, trains the ``precision=off`` twin and each BFT variant with the
same settings (the shipped experiment configs plus the overrides below) until
validation NDCG@10 stops improving, tests the best checkpoint, and keeps the
per-user test ranks. Writes ``results/rec/<dataset>_<backbone>.md`` (+ ``.png``
and ``.json``): overall and per-stratum HR@10 / NDCG@10, the mean and the
paired difference to the off twin over the same test users (with its paired
standard error), seconds per training epoch, the spread of the learned prior
precision tau and the mean Kalman gain per item stratum.

Example (the command behind ``results/rec/beauty_sasrec.md``)::

    OMP_WAIT_POLICY=PASSIVE python bench/reproduce_rec.py --dataset beauty \\
        --backbone sasrec --seeds 0 1 2 --variants off on_constant on_frequency

Runs are resumable: a finished run (its ``ranks.npy``) is not trained again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.hardware import device_name, threads  # noqa: E402
from common.paired import hits, ndcg, paired  # noqa: E402
from common.runs import (  # noqa: E402
    RANK_FILES,
    archive_run,
    by_protocol,
    load_runs,
)
from common.runs import layer_gains as layer_gains  # noqa: E402  (read by tests)
from common.tables import write_summary  # noqa: E402

from bft_lightning.cli import main as cli_main  # noqa: E402
from bft_lightning.metrics.report import write_text_atomic  # noqa: E402
from bft_lightning.metrics.strata import (  # noqa: E402
    assign_item_stratum,
    assign_user_bucket,
    history_buckets,
    popularity_quartiles,
)
from bft_lightning.utils import EpochTimer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL_TITLES = {
    "seen_masked": "seen items excluded from the ranking (the published tables' convention)",
    "unmasked": "seen items kept in the ranking",
}
COMMAND_ENV = "BFT_REPRODUCE_COMMAND"  # the parent's command, for the children of --jobs
# the variants below were run with the prior table at the weights' learning rate; SASRec's
# config now defaults to 10x (on_tau_lr10), so every other variant pins 1x to rerun as run
_LR1 = "--model.init_args.prior_lr_scale=1"
# SASRec's shipped recipe until the tuned comparison: the full softmax, dropout 0.2, and the
# prior table at 10x the weights' rate. Every table of this script was trained with it, so
# `--recipe tables` (the default) pins it beneath the variants' and the command's own
# options, and each table's command reruns as it ran; `--recipe shipped` trains the configs
# as they ship now (256 uniform negatives, dropout 0.5, results/rec/FINDINGS.md).
_SASREC_TABLES = [
    "--model.init_args.loss=ce", "--model.init_args.negatives=popularity",
    "--model.init_args.num_negatives=100", "--model.init_args.backbone.init_args.dropout=0.2",
]  # fmt: skip
SASREC_TABLES_RECIPE = {
    "off": _SASREC_TABLES,
    "on": [*_SASREC_TABLES, "--model.init_args.prior_lr_scale=10"],
}
VARIANTS = {
    "off": ("off", []),
    "on_constant": ("on", [_LR1, "--model.init_args.backbone.init_args.prior_init=constant"]),
    "on_frequency": ("on", [_LR1, "--model.init_args.backbone.init_args.prior_init=frequency"]),
    "on_shuffled": (
        "on",
        [_LR1, "--model.init_args.backbone.init_args.prior_init=frequency_shuffled"],
    ),
    "on_inverse": (
        "on",
        [_LR1, "--model.init_args.backbone.init_args.prior_init=frequency_inverse"],
    ),
    "on_mlp": ("on", [_LR1, "--model.init_args.backbone.init_args.prior=mlp"]),
    "on_head": ("on", [_LR1, "--model.init_args.backbone.init_args.head=precision"]),
    "gate": ("off", ["--model.init_args.backbone.init_args.attention_gate=sigmoid"]),
    # routes on top of the default (frequency) prior
    "on_g64": (
        "on",
        [_LR1, "--model.init_args.backbone.init_args.groups=64"],
    ),  # per-channel groups at d = 64
    "on_q01": ("on", [_LR1, "--model.init_args.backbone.init_args.q_init=0.1"]),
    "on_nu0_10": ("on", [_LR1, "--model.init_args.backbone.init_args.nu0=10"]),
    "on_tau_lr10": ("on", ["--model.init_args.prior_lr_scale=10"]),
    # one Kalman gain per head, before W_O (the spec: per residual group, after W_O)
    "on_gain_head": ("on", [_LR1, "--model.init_args.backbone.init_args.gain=head"]),
    "on_gain_head_lr10": (
        "on",
        ["--model.init_args.prior_lr_scale=10", "--model.init_args.backbone.init_args.gain=head"],
    ),  # the per-head gain on top of SASRec's default (tau at 10x lr)
    # prior scale c = 8 (log c ~ 2.1) instead of 1 / mean Var(h0): BERT4Rec's unscaled
    # embeddings put log c at ~7.2, far above its layer-0 log lambda_obs (~1.5), so the
    # first layer's Kalman gain was ~0.01 (results/rec/DETAILS.md)
    "on_c8": ("on", [_LR1, "--model.init_args.backbone.init_args.prior_scale=8"]),
    # ablation: attention without the keys' precision bias; the gain and dynamics kept
    "on_nobias": ("on", [_LR1, "--model.init_args.backbone.init_args.key_precision=false"]),
}


def run_one(args: argparse.Namespace, variant: str, seed: int, out: Path) -> dict | None:
    """Train + test one (variant, seed); cache per-user ranks and a summary."""
    done = out / "summary.json"
    settings = _settings(args)
    archived = Path(args.results_dir) / "runs" / out.parent.name / out.name / "summary.json"
    if not done.exists() and archived.exists():
        # finished elsewhere (another machine, a deleted run folder): its committed results
        # stand; delete the archived folder to train the seed again
        done = archived
        print(f"{variant} seed {seed}: finished, archived in {archived.parent}", flush=True)
    if done.exists():
        summary = json.loads(done.read_text())
        saved = summary.get("settings")  # absent in runs made before it was recorded
        if saved is not None and saved != settings:
            raise SystemExit(
                f"{done.parent} holds a finished run with other settings ({saved}) than this "
                f"command's ({settings}): use another --tag, or delete that folder"
            )
        return summary
    lock = out / "running"
    if lock.exists() and _alive(int(lock.read_text())):
        print(f"{out} is being trained by process {lock.read_text()}; skipped", flush=True)
        return None
    lock.write_text(str(os.getpid()))
    precision, extra = VARIANTS[variant]
    if args.backbone == "sasrec" and getattr(args, "recipe", None) == "tables":
        extra = [*SASREC_TABLES_RECIPE[precision], *extra]
    config = ROOT / "configs" / "experiments" / f"{args.backbone}_{precision}_{args.dataset}.yaml"
    if getattr(args, "base_config", None):  # a study's stored config: what its trials ran
        config = out / "study_config.yaml"
        write_text_atomic(config, args.base_config)
    argv = ["--config", str(config), f"--seed_everything={seed}", f"--data.init_args.seed={seed}",
            f"--trainer.max_epochs={args.max_epochs}", "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={out}", "--trainer.logger.init_args.name=tb",
            "--trainer.logger.init_args.version=0",
            f"--data.init_args.data_root={args.data_root}",
            f"--model.init_args.loss_normalization={args.loss_normalization}",
            *extra, *args.override]  # fmt: skip
    if args.accelerator:
        argv.append(f"--trainer.accelerator={args.accelerator}")
    cli = cli_main(argv, run=False)
    if cli.trainer.world_size > 1:
        # the per-user states saved below are each process's own after compute(), and
        # the run lock is per process: one device per run (runs go in parallel with --jobs)
        lock.unlink(missing_ok=True)
        raise SystemExit(
            f"bench/reproduce_rec.py trains each run on one device (world size here: "
            f"{cli.trainer.world_size}); run several at once with --jobs instead of "
            "overriding --trainer.devices / --trainer.strategy"
        )
    timer = EpochTimer()
    cli.trainer.callbacks.append(timer)
    ckpts = out / "tb" / "version_0" / "checkpoints"
    fit_done = out / "fit_done"
    if not fit_done.exists():
        # an interrupted run continues from last.ckpt (Lightning writes it when the
        # monitored metric improves, so training resumes from the best epoch so far)
        last = ckpts / "last.ckpt"
        resume = str(last) if last.exists() else None
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=resume)
        write_text_atomic(fit_done, json.dumps({"epochs": cli.trainer.current_epoch}))
    best = str(ckpts / "best.ckpt")
    cli.trainer.test(cli.model, datamodule=cli.datamodule, ckpt_path=best, verbose=False)
    metric = cli.model.test_metric
    by_protocol = metric.ranks_by_protocol  # both conventions, from one pass
    for protocol, ranks in by_protocol.items():
        np.save(out / RANK_FILES[protocol], ranks.cpu().numpy())
    np.save(out / "targets.npy", metric.target.cpu().numpy())
    np.save(out / "history_len.npy", metric.history_len.cpu().numpy())
    summary = {
        "variant": variant, "seed": seed, "metrics": cli.model.test_results,
        "epochs": json.loads(fit_done.read_text()).get("epochs"),
        "sec_per_epoch": float(np.median(timer.times)) if timer.times else None,
        "best_epoch": _best_epoch(cli.trainer), "tau": _tau_stats(cli.model.model),
        "command": args.command, "hardware": _hardware(cli.trainer), "jobs": args.jobs,
        "settings": settings, "protocols": sorted(by_protocol),
    }  # fmt: skip
    np.save(out / "item_frequency.npy", cli.datamodule.item_frequency.numpy())
    write_text_atomic(done, json.dumps(summary, indent=1))  # last: marks the run finished
    lock.unlink(missing_ok=True)
    archive_run(out, Path(args.results_dir))
    return summary


def _settings(args: argparse.Namespace) -> dict:
    """What a run's result depends on beyond its variant, seed and folder (a finished
    run is reused only by a command with the same settings)."""
    settings = {
        "max_epochs": args.max_epochs, "override": list(args.override),
        "loss_normalization": args.loss_normalization, "accelerator": args.accelerator,
    }  # fmt: skip
    if getattr(args, "recipe", None) == "shipped":  # the tables' recipe is the unmarked one
        settings["recipe"] = "shipped"
    if getattr(args, "base_config", None):  # trained from a study's config, not the files
        import yaml

        canonical = json.dumps(yaml.safe_load(args.base_config), sort_keys=True, default=str)
        digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
        settings["base_config_sha256"] = digest
    return settings


def _hardware(trainer: L.Trainer) -> str:
    return device_name(trainer.strategy.root_device) or f"cpu, {threads()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _best_epoch(trainer: L.Trainer) -> int | None:
    ckpt = trainer.checkpoint_callback
    path = getattr(ckpt, "best_model_path", "")
    if not path:
        return None
    return int(torch.load(path, map_location="cpu", weights_only=True)["epoch"])


def _tau_stats(model: torch.nn.Module) -> dict | None:
    prior = getattr(model, "prior", None)
    table = getattr(prior, "log_tau", None)
    if table is None:
        return None
    log_tau = table.weight.detach()[1 : model.num_items + 1].mean(-1)
    q = torch.quantile(log_tau, torch.tensor([0.1, 0.5, 0.9]))
    return {"mean": float(log_tau.mean()), "std": float(log_tau.std()),
            "p10": float(q[0]), "p50": float(q[1]), "p90": float(q[2])}  # fmt: skip


def _per_user(runs: dict, variant: str, seeds: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Seed-averaged per-user HR@10 and NDCG@10 of a variant (seeds it has)."""
    ranks = np.stack([runs[(variant, s)]["ranks"] for s in seeds])
    seen = (ranks >= 0).all(0)
    return hits(ranks).mean(0)[seen], ndcg(ranks).mean(0)[seen]


def _seen(runs: dict, variant: str, seeds: list[int]) -> np.ndarray:
    return (np.stack([runs[(variant, s)]["ranks"] for s in seeds]) >= 0).all(0)


def _history_lengths(runs: dict) -> np.ndarray | None:
    """Per-user training-history length (-1 = not a test user), from any run that saved it."""
    for run in runs.values():
        if run.get("history_len") is not None:
            return run["history_len"]
    return None


def summarise(args: argparse.Namespace, runs: dict, seeds: list[int], out: Path) -> list[dict]:
    """Rows of the results table: overall and Q0, mean over seeds, paired deltas."""
    first = next(iter(runs.values()))
    # every paired comparison below assumes the same test users in every run
    seen_first = np.asarray(first["ranks"]) >= 0
    for key, run in runs.items():
        if not np.array_equal(np.asarray(run["ranks"]) >= 0, seen_first):
            raise ValueError(
                f"run {key} ranked other test users than run {next(iter(runs))} "
                f"({int((np.asarray(run['ranks']) >= 0).sum())} against {int(seen_first.sum())}):"
                " its ranks.npy is incomplete or from other data; delete that run's directory "
                "and train it again"
            )
    freq = torch.as_tensor(first["item_frequency"])
    strata = assign_item_stratum(
        torch.as_tensor(first["targets"]).clamp_min(1), freq, popularity_quartiles(freq)
    ).numpy()
    item_q = assign_item_stratum(torch.arange(1, len(freq)), freq, popularity_quartiles(freq))
    sizes = {
        "items": [int((item_q == q).sum()) for q in range(4)],
        "max_freq": [int(freq[1:][item_q == q].max()) if (item_q == q).any() else -1
                     for q in range(4)],
        "users": [int((strata[np.asarray(first["ranks"]) >= 0] == q).sum()) for q in range(4)],
    }  # fmt: skip
    lengths = _history_lengths(runs)
    cold = None
    if lengths is not None:
        seen = lengths >= 0
        bounds = history_buckets(torch.as_tensor(lengths[seen]))
        cold = (assign_user_bucket(torch.as_tensor(lengths), bounds).numpy() == 0) & seen
        sizes["cold_users"], sizes["cold_max_len"] = int(cold.sum()), int(bounds[0])
    rows = []
    for variant in [v for v in VARIANTS if any(key[0] == v for key in runs)]:
        have = [s for s in seeds if (variant, s) in runs and ("off", s) in runs]
        if not have:
            continue
        hr, nd = _per_user(runs, variant, have)
        hr0, nd0 = _per_user(runs, "off", have)
        row = {"dataset": args.dataset, "backbone": args.backbone, "tag": _summary_tag(args),
               "variant": variant, "seeds": have, "hr10": float(hr.mean()),
               "ndcg10": float(nd.mean()), "noise": getattr(args, "noise", 0.0),
               "strata_sizes": sizes}  # fmt: skip
        for q in range(4):
            m = strata == q
            row[f"hr10_q{q}"], row[f"ndcg10_q{q}"] = float(hr[m].mean()), float(nd[m].mean())
            if variant != "off":
                row[f"paired_delta_hr10_q{q}"], row[f"paired_se_hr10_q{q}"] = paired(hr0[m], hr[m])
                row[f"off_hr10_q{q}"] = float(hr0[m].mean())
        if cold is not None:
            c = cold[_seen(runs, variant, have)]
            row["hr10_cold"] = float(hr[c].mean())
            if variant != "off":
                row["paired_delta_hr10_cold"], row["paired_se_hr10_cold"] = paired(hr0[c], hr[c])
                row["off_hr10_cold"] = float(hr0[c].mean())
        if variant != "off":
            # training noise: the same-seed difference of each seed (seed s of the
            # variant against seed s of the off twin), besides the pooled paired SE
            # (test users are the same in every run, so the seen masks agree)
            per_seed = [
                (_per_user(runs, variant, [s])[0], _per_user(runs, "off", [s])[0],
                 strata[_seen(runs, variant, [s])] == 0)
                for s in have
            ]  # fmt: skip
            row["per_seed_delta_hr10"] = [float(a.mean() - b.mean()) for a, b, _ in per_seed]
            row["per_seed_delta_hr10_q0"] = [
                float(a[rare].mean() - b[rare].mean()) for a, b, rare in per_seed
            ]
            row["paired_delta_hr10"], row["paired_se_hr10"] = paired(hr0, hr)
            row["off_hr10"] = float(hr0.mean())
            row["paired_delta_ndcg10"], row["paired_se_ndcg10"] = paired(nd0, nd)
        summaries = [runs[(variant, s)]["summary"] for s in have]
        timed = [s["sec_per_epoch"] for s in summaries if s["sec_per_epoch"] is not None]
        row["sec_per_epoch"] = float(np.mean(timed)) if timed else math.nan
        row["epochs"] = [s["epochs"] for s in summaries]
        row["best_epoch"] = [s["best_epoch"] for s in summaries]
        row["gain_q"] = [
            float(np.mean([s["metrics"].get(f"item_q{q}/gain", math.nan) for s in summaries]))
            for q in range(4)
        ]
        per_run = [runs[(variant, s)]["layer_gain"] for s in have]
        layers = sorted(set.intersection(*(set(g) for g in per_run))) if per_run else []
        row["layer_gain_q"] = {
            name: [float(np.mean([g[name][q] for g in per_run])) for q in range(4)]
            for name in layers
        }
        row["tau"] = summaries[0]["tau"]
        row["commands"] = sorted({s["command"] for s in summaries if "command" in s})
        row["hardware"] = sorted({s["hardware"] for s in summaries if "hardware" in s})
        row["jobs"] = max(s.get("jobs", 1) for s in summaries)
        rows.append(row)
    return rows


def _section(intro: str, columns: list[str]) -> list[str]:
    """A blank line, the intro, a blank line and a table header with these columns."""
    return ["", intro, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _strata_sentence(rows: list[dict]) -> list[str]:
    """The strata's sizes (items, training-frequency range, test users), when known."""
    sizes = next((r["strata_sizes"] for r in rows if "strata_sizes" in r), None)
    if sizes is None:
        return []
    parts, low = [], 0
    for q, (n, top, users) in enumerate(
        zip(sizes["items"], sizes["max_freq"], sizes["users"], strict=True)
    ):
        if n:  # an empty group (ties at a cut point) is left out
            parts.append(f"Q{q}: {n} items seen {low}-{top} times in training, {users} test users")
            low = top + 1
    groups = "; ".join(parts)
    cold = (
        f"; cold: {sizes['cold_users']} users with at most {sizes['cold_max_len']} training items"
        if "cold_users" in sizes
        else ""
    )
    return [f"Strata: {groups}{cold}.", ""]


def protocol_note(rows: list[dict]) -> str:
    return f" ({rows[0]['protocol'].replace('_', ' ')})" if rows else ""


def write_markdown(args: argparse.Namespace, rows: list[dict], path: Path) -> None:
    """The table of each evaluation convention the runs kept, seen-masked first."""
    protocols = list(dict.fromkeys(r.get("protocol", "unmasked") for r in rows))
    parts = []
    for i, protocol in enumerate(protocols):
        mine = [r for r in rows if r.get("protocol", "unmasked") == protocol]
        lines = _markdown_lines(args, mine, protocol)
        parts.append(
            "\n".join(lines if i == 0 else [f"## {PROTOCOL_TITLES[protocol]}", *lines[1:]])
        )
    write_text_atomic(path, "\n\n".join(parts) + "\n")


def _markdown_lines(args: argparse.Namespace, rows: list[dict], protocol: str) -> list[str]:
    commands = sorted({c for r in rows for c in r.get("commands", [])}) or [args.command]
    hardware = sorted({h for r in rows for h in r.get("hardware", [])})
    shared = any(r.get("jobs", 1) > 1 for r in rows)
    tag = args.tag
    if args.loss_normalization == "rows":
        tag = "loss per batch row" + (f", {args.tag}" if args.tag else "")
    title = f"{args.backbone} on {args.dataset}" + (f" ({tag})" if tag else "")
    lines = [f"# {title}: precision off vs on", "",
             "Command" + ("s" if len(commands) > 1 else "") + ": "
             + ", ".join(f"`{c}`" for c in commands), "",
             *([f"Hardware: {', '.join(hardware)}.", ""] if hardware else []),
             *(["s/epoch of runs trained with `--jobs N` were measured with up to N runs "
                "sharing the device (and other commands' runs beside them), so they compare "
                "variants within a table, not machines.", ""] if shared else []),
             f"Full ranking over all items, leave-one-out, {PROTOCOL_TITLES[protocol]}; "
             "best-validation "
             "(NDCG@10) checkpoint; per-user metrics averaged over the seeds listed, then the "
             "paired difference to the off twin over the same test users (± paired SE: "
             "the spread over users, not over trainings; the same-seed table at the end "
             "gives the SE over seeds). Q0..Q3 = the target item's popularity group: "
             "quartiles of the items' training frequencies, cut by item, items tied at a "
             "cut point all in the lower group (so Q0 may hold more than a quarter of the "
             "items); cold = users in the shortest-history bucket (B0, history-length "
             "quartiles over all test users, same tie rule). Variants from earlier "
             "invocations with the same runs directory are included.", "",
             *_strata_sentence(rows),
             "| variant | seeds | HR@10 | NDCG@10 | ΔHR@10 (SE) | ΔNDCG@10 (SE) | HR@10 Q0 | "
             "ΔHR@10 Q0 (SE) | ΔHR@10 Q3 (SE) | ΔHR@10 cold (SE) | s/epoch | epochs (best) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:

        def d(key: str, r: dict = r) -> str:
            return "–" if key not in r else f"{r[key]:+.4f} ({r[key.replace('delta', 'se')]:.4f})"

        lines.append(
            f"| {r['variant']} | {r['seeds']} | {r['hr10']:.4f} | {r['ndcg10']:.4f} | "
            f"{d('paired_delta_hr10')} | {d('paired_delta_ndcg10')} | {r['hr10_q0']:.4f} | "
            f"{d('paired_delta_hr10_q0')} | {d('paired_delta_hr10_q3')} | "
            f"{d('paired_delta_hr10_cold')} | "
            f"{r['sec_per_epoch']:.1f} | {r['epochs']} ({r['best_epoch']}) |"
        )
    strata = ["", "_q0", "_q1", "_q2", "_q3", "_cold"]
    lines += _section(
        "Relative change in HR@10 by stratum, the unit of the paper's claims: the paired "
        "difference over the off twin's HR@10 in that stratum on the same users and seeds "
        "(± paired SE over the same base).",
        ["variant", "all", "Q0 (rarest)", "Q1", "Q2", "Q3", "cold"],
    )
    for r in rows:
        if r["variant"] == "off":
            continue

        def rel(sfx: str, r: dict = r) -> str:
            base = r.get(f"off_hr10{sfx}")
            if not base or f"paired_delta_hr10{sfx}" not in r:
                return "–"
            delta, se = r[f"paired_delta_hr10{sfx}"], r[f"paired_se_hr10{sfx}"]
            return f"{100 * delta / base:+.1f}% ({100 * se / base:.1f})"

        lines.append(f"| {r['variant']} | " + " | ".join(rel(x) for x in strata) + " |")
    lines += _section(
        "Mechanism diagnostics (first seed's tau; gain averaged over seeds):",
        ["variant", "log tau mean", "log tau std", "p10 / p50 / p90", "mean K Q0", "Q1", "Q2",
         "Q3"],
    )  # fmt: skip
    for r in rows:
        t = r["tau"]
        tau = (
            "– | – | –"
            if t is None
            else (
                f"{t['mean']:.2f} | {t['std']:.3f} | "
                f"{t['p10']:.2f} / {t['p50']:.2f} / {t['p90']:.2f}"
            )
        )
        g = " | ".join("–" if math.isnan(x) else f"{x:.3f}" for x in r["gain_q"])
        lines.append(f"| {r['variant']} | {tau} | {g} |")
    layered = [r for r in rows if r.get("layer_gain_q") and VARIANTS[r["variant"]][0] == "on"]
    if layered:
        lines += _section(
            "Kalman gain K of the item tokens in each layer by the token's own popularity "
            "quartile (test, averaged over seeds; the mean K columns above are at the "
            "predicting position, by the target's quartile):",
            ["variant", "layer", "K Q0", "Q1", "Q2", "Q3"],
        )
        for r in layered:
            for name, g in r["layer_gain_q"].items():
                short = name.removeprefix("model.")
                lines.append(
                    f"| {r['variant']} | {short} | " + " | ".join(f"{x:.3f}" for x in g) + " |"
                )
    lines += _section(
        "Same-seed differences in HR@10 (variant seed s minus off seed s): the spread of "
        "these is the training noise the pooled paired SE does not see; SE over seeds = "
        "SD / sqrt(seeds), the one to read against the mean when seeds are few.",
        ["variant", "seeds", "per-seed ΔHR@10", "mean", "SD across seeds", "SE over seeds",
         "per-seed ΔHR@10 Q0", "Q0 mean (SE over seeds)"],
    )  # fmt: skip
    for r in rows:
        if "per_seed_delta_hr10" in r:
            deltas = np.array(r["per_seed_delta_hr10"])
            rare_d = np.array(r.get("per_seed_delta_hr10_q0", []))
            n = len(deltas)
            sd = f"{deltas.std(ddof=1):.4f}" if n > 1 else "–"
            se = f"{deltas.std(ddof=1) / math.sqrt(n):.4f}" if n > 1 else "–"
            rare_se = (
                f"{rare_d.mean():+.4f} ({rare_d.std(ddof=1) / math.sqrt(len(rare_d)):.4f})"
                if len(rare_d) > 1
                else "–"
            )
            per = ", ".join(f"{x:+.4f}" for x in deltas)
            rare = ", ".join(f"{x:+.4f}" for x in rare_d)
            lines.append(
                f"| {r['variant']} | {r['seeds']} | {per} | {deltas.mean():+.4f} | {sd} | "
                f"{se} | {rare} | {rare_se} |"
            )
    return lines


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.5))
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        vals = [r[f"hr10_q{q}"] for q in range(4)] + [r["hr10"]]
        ax.bar(np.arange(5) + i * width, vals, width, label=r["variant"])
    ax.set_xticks(np.arange(5) + 0.4 - width / 2, ["Q0 (rare)", "Q1", "Q2", "Q3", "all"])
    ax.set_ylabel("test HR@10")
    ax.set_title(title)
    ax.legend()
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", default="beauty", help="a configs/data/<name>.yaml")
    p.add_argument("--backbone", default="sasrec", choices=["sasrec", "bert4rec", "hstu"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--variants", nargs="+", default=["off", "on_constant", "on_frequency"],
        choices=list(VARIANTS), metavar="VARIANT",
        help=f"any of: {', '.join(VARIANTS)}",
    )  # fmt: skip
    p.add_argument("--max-epochs", type=int, default=200)
    p.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--runs-dir", default=str(ROOT / "logs" / "reproduce"))
    p.add_argument("--results-dir", default=str(ROOT / "results" / "rec"))
    p.add_argument(
        "--override",
        action="append",
        default=[],
        help="an extra CLI argument for every run, as --override=--trainer.x=1 (repeatable)",
    )
    p.add_argument(
        "--loss-normalization", choices=["targets", "rows"], default="targets",
        help="the task's loss_normalization; the tables in results/rec were run with "
        "'targets' (per-target means of length-bucketed batches), so that is the default "
        "here; 'rows' (the task's default) runs go to <dataset>_<backbone>_rows...",
    )  # fmt: skip
    p.add_argument(
        "--recipe", choices=["tables", "shipped"], default="tables",
        help="SASRec's recipe: 'tables' pins the one every table here was run with (full "
        "softmax, dropout 0.2, prior table at 10x lr) beneath the variants' and --override's "
        "options; 'shipped' trains the configs as they ship now",
    )  # fmt: skip
    p.add_argument("--report-only", action="store_true", help="only rewrite the tables")
    p.add_argument(
        "--noise", type=float, default=0.0,
        help="share of training items replaced by random ones (the DataModule's train_noise; "
        "validation and test targets stay clean); name the setting with --tag",
    )  # fmt: skip
    p.add_argument("--accelerator", default=None, help="override the config's (cpu, gpu, auto)")
    p.add_argument(
        "--jobs", type=int, default=1,
        help="train this many (variant, seed) runs at once, each in its own process "
        "(several small models share one GPU well; on a CPU keep 1)",
    )  # fmt: skip
    p.add_argument(
        "--tag", default="",
        help="name of a setting (e.g. the overrides used); runs and tables go to "
        "<dataset>_<backbone>_<tag>",
    )  # fmt: skip
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # VARIANT:SEED, for --jobs

    args = p.parse_args()
    if args.noise:
        if any("train_noise" in o for o in args.override):
            p.error("give the noise once: --noise or an override of train_noise, not both")
        args.override.append(f"--data.init_args.train_noise={args.noise}")
    if any("loss_normalization" in o for o in args.override):
        p.error("set the loss normalization with --loss-normalization (it names the run folder)")
    argv = sys.argv[1:]
    # the command as the user typed it (a child of --jobs inherits its parent's)
    threads = os.environ.get("OMP_NUM_THREADS")
    args.command = os.environ.get(COMMAND_ENV) or (
        "OMP_WAIT_POLICY=PASSIVE "
        + (f"OMP_NUM_THREADS={threads} " if threads else "")
        + "python bench/reproduce_rec.py "
        + " ".join(argv)
    )
    if "off" not in args.variants:
        args.variants.insert(0, "off")
    base = Path(args.runs_dir) / _stem(args)
    if args.only:  # one run, no report (a child of --jobs)
        variant, seed = args.only.rsplit(":", 1)
        out = base / f"{variant}_s{seed}"
        out.mkdir(parents=True, exist_ok=True)
        run_one(args, variant, int(seed), out)
        return
    if args.report_only:
        report(args, load_runs(base, list(VARIANTS), Path(args.results_dir)))
        return
    todo = [(v, s) for s in args.seeds for v in args.variants]
    if args.jobs > 1:
        failed = _run_parallel(todo, args.jobs, argv, args.command)
        runs = load_runs(base, list(VARIANTS), Path(args.results_dir))
        if runs:
            report(args, runs)
        if failed:
            raise SystemExit(f"runs failed (their logs are above): {failed}")
        return
    for variant, seed in todo:
        out = base / f"{variant}_s{seed}"
        out.mkdir(parents=True, exist_ok=True)
        run_one(args, variant, seed, out)
        report(args, load_runs(base, list(VARIANTS), Path(args.results_dir)))


def _summary_tag(args: argparse.Namespace) -> str:
    """The table's setting in ``summary.json``: ``--tag``, prefixed by ``rows`` for runs
    with ``--loss-normalization rows`` (so they never share a key with the older tables)."""
    if args.loss_normalization != "rows":
        return args.tag
    return "rows" + (f"_{args.tag}" if args.tag else "")


def _stem(args: argparse.Namespace) -> str:
    rows = "_rows" if args.loss_normalization == "rows" else ""
    return f"{args.dataset}_{args.backbone}{rows}" + (f"_{args.tag}" if args.tag else "")


def _run_parallel(
    todo: list[tuple[str, int]], jobs: int, argv: list[str], command: str
) -> list[str]:
    """Each (variant, seed) in a child process, at most ``jobs`` at a time.

    Children get one OpenMP thread unless ``OMP_NUM_THREADS`` says otherwise;
    if this process stops (Ctrl-C, an error), its children are stopped too.
    """
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env[COMMAND_ENV] = command
    pending = [f"{v}:{s}" for v, s in todo]
    running: dict[str, subprocess.Popen] = {}
    failed = []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                key = pending.pop(0)
                cmd = [sys.executable, __file__, *argv, "--only", key]
                running[key] = subprocess.Popen(cmd, env=env)
            time.sleep(2)
            for key, proc in list(running.items()):
                if proc.poll() is not None:
                    del running[key]
                    if proc.returncode != 0:
                        failed.append(key)
                    print(f"run {key} finished with exit code {proc.returncode}", flush=True)
    finally:
        for proc in running.values():
            proc.terminate()
        for proc in running.values():
            proc.wait()
    return failed


def report(args: argparse.Namespace, runs: dict) -> None:
    seeds = sorted({s for _, s in runs})
    rows = []
    for protocol, protocol_runs in by_protocol(runs).items():
        for row in summarise(args, protocol_runs, seeds, Path(args.results_dir)):
            rows.append({**row, "protocol": protocol})
    res = Path(args.results_dir)
    res.mkdir(parents=True, exist_ok=True)
    stem = res / _stem(args)
    write_markdown(args, rows, stem.with_suffix(".md"))
    write_text_atomic(stem.with_suffix(".json"), json.dumps(rows, indent=1))
    first = [r for r in rows if r["protocol"] == rows[0]["protocol"]] if rows else []
    plot(first, stem.with_suffix(".png"), stem.name.replace("_", " ") + protocol_note(first))
    write_summary(res)


if __name__ == "__main__":
    main()
