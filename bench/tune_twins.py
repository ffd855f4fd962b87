"""The off and on twins compared at the same tuning budget, then paired on test.

1. Two ``tune`` studies (``python -m bft_lightning tune``, docs/tune.md): the off twin
   on ``configs/search/<backbone>_off.yaml``, BFT on ``<backbone>_on.yaml`` (the off
   space plus BFT's own options, through ``extends``), each from its experiment config
   ``configs/experiments/<backbone>_<off|on>_<dataset>.yaml``, with the same sampler
   seed, trial budget, pruner, data and shared overrides.
2. Each twin's best configuration retrained with every seed and tested, through
   ``bench/reproduce_rec.py``'s ``run_one`` (its per-user ranks, run folders and
   resumability); the paired comparison on the same test users (overall, the
   rarest-item quartile Q0, the coldest users) through its ``summarise``.
3. ``<results-dir>/tuned/<dataset>_<backbone>.md`` (+ ``.json``, ``.png``): the two
   studies' best trials and the paired table; its rows, in ``summary.json``'s schema
   with ``tuned: true`` and ``trials``, are added to ``<results-dir>/summary.json``.

The studies' storage (SQLite databases) and their reports (``best.yaml``, trials
tables, plots) go to ``--storage-dir`` (default ``<results-dir>/tune``), small enough
to commit; the trials' and retrainings' run folders (checkpoints) to ``--runs-dir``.
Every step resumes: a rerun continues the studies and trains only missing seeds.

    OMP_WAIT_POLICY=PASSIVE python bench/tune_twins.py --dataset beauty --backbone sasrec \\
        --trials 24 --seeds 0 1 2 --pruner median --sampler-seed 0
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reproduce_rec as rr  # noqa: E402  (a sibling script, not a package)
from common.tables import summary_row, tuned_name, write_summary  # noqa: E402

from bft_lightning.metrics.report import write_text_atomic  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# paths relative to the repository root (the script runs there): a study's stored fit
# arguments are then the same in every checkout, so any clone continues it
EXPERIMENTS = Path("configs") / "experiments"
TWINS = {"off": "off", "on": "tuned_on"}  # twin -> reproduce_rec variant
rr.VARIANTS.setdefault("tuned_on", ("on", []))  # the on twin at its tuned values only


def _space(args: argparse.Namespace) -> str:
    return getattr(args, "space", None) or args.backbone


def study_name(args: argparse.Namespace, twin: str) -> str:
    """``<dataset>_<backbone>[_<space>]_<twin>``: the space is named when it is not the
    backbone's own. Noise is not in it: the noisy rows retrain the clean study's choice."""
    return f"{tuned_name(args.dataset, args.backbone, _space(args), 0.0)}_{twin}"


def study_args(args: argparse.Namespace, twin: str) -> list[str]:
    """The ``tune`` command line of one twin's study (the same for both but the files)."""
    name = study_name(args, twin)
    storage = Path(args.storage_dir)
    return [
        "--config", str(EXPERIMENTS / f"{args.backbone}_{twin}_{args.dataset}.yaml"),
        "--search", str(Path("configs") / "search" / f"{_space(args)}_{twin}.yaml"),
        "--trials", str(args.trials), "--storage", f"sqlite:///{storage / name}.db",
        "--study-name", name, "--pruner", args.pruner, "--sampler-seed", str(args.sampler_seed),
        *([f"--prune-after={after}"] if (after := getattr(args, "prune_after", None)) is not None
          else []),
        "--workers", str(args.jobs), "--out", str(storage / name),
        *shared_overrides(args, noise=False),
        f"--trainer.logger.init_args.save_dir={Path(args.runs_dir) / 'tune'}",
        "--trainer.logger.init_args.name=trials",
    ]  # fmt: skip


def shared_overrides(args: argparse.Namespace, noise: bool = True) -> list[str]:
    """What both studies and every retraining share (data, epochs, loss normalization).
    The training noise (``--noise``) applies to the retrainings only: each twin is
    retrained on the noisy data at the configuration it chose on the clean data."""
    out = [
        f"--trainer.max_epochs={args.max_epochs}",
        f"--data.init_args.data_root={args.data_root}",
        f"--model.init_args.loss_normalization={args.loss_normalization}",
    ]
    if args.noise and noise:
        out.append(f"--data.init_args.train_noise={args.noise}")
    if args.accelerator:
        out.append(f"--trainer.accelerator={args.accelerator}")
    return out + list(args.override)


def run_study(args: argparse.Namespace, twin: str) -> dict[str, Any]:
    """Run (or continue) one twin's study; its best trial's values and value."""
    import optuna

    from bft_lightning.tuning.cli import main as tune
    from bft_lightning.tuning.study import CONFIG_ATTR

    code = tune(study_args(args, twin))
    if code != 0:
        raise SystemExit(f"the {twin} twin's study ended with exit status {code}")
    name = study_name(args, twin)
    storage = f"sqlite:///{Path(args.storage_dir) / name}.db"
    study = optuna.load_study(study_name=name, storage=storage)
    best = study.best_trial
    meta = study.user_attrs.get("bft_tune", {})
    return {
        "study": name, "storage": storage, "trial": best.number, "value": best.value,
        "monitor": meta.get("monitor"), "values": best.user_attrs.get("values", best.params),
        "fit_config": retrain_config(study.user_attrs.get(CONFIG_ATTR)),
    }  # fmt: skip


# what a run's config holds; the rest of a stored ``fit`` config are that command's options
RETRAIN_SECTIONS = ("seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler")


def retrain_config(made_with: str | None) -> str | None:
    """The config a study's trials ran with (stored with the study), as the retrainings
    read it: its model, data, trainer, optimizer and seed, without the ``fit`` command's
    run options (``ckpt_path``, ``weights_only``, ...). Retraining from it, not
    from the config files, keeps the chosen values on the model and data they were
    chosen for, whatever the files say since. None for a study made before the config
    was stored: its retrainings read the files, as its trials did."""
    import yaml

    if not made_with:
        return None
    config = yaml.safe_load(made_with)
    if not isinstance(config, dict):
        return None
    kept = {k: v for k, v in config.items() if k in RETRAIN_SECTIONS}
    return yaml.safe_dump(kept, sort_keys=False)


def status(args: argparse.Namespace) -> list[str]:
    """Each twin's study as it stands, one line a twin (also printed); its trials table
    (``trials.md``, ``.csv``) rewritten beside its storage. Nothing is run."""
    import optuna
    from optuna.trial import TrialState

    from bft_lightning.tuning.report import write_tables
    from bft_lightning.tuning.study import counted

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    lines = []
    for twin in TWINS:
        name = study_name(args, twin)
        db = Path(args.storage_dir) / f"{name}.db"
        if not db.is_file():
            lines.append(f"{twin}: no study yet ({db})")
            continue
        study = optuna.load_study(study_name=name, storage=f"sqlite:///{db}")
        monitor = study.user_attrs.get("bft_tune", {}).get("monitor", "value")
        out = Path(args.storage_dir) / name
        out.mkdir(parents=True, exist_ok=True)
        write_tables(study, out, monitor)
        trials = study.get_trials(deepcopy=False)
        done = counted(study)
        by = {s: sum(t.state == s for t in done) for s in (TrialState.COMPLETE, TrialState.PRUNED)}
        running = sum(t.state == TrialState.RUNNING for t in trials)
        line = (
            f"{twin}: {len(done)}/{args.trials} trials finished ({by[TrialState.COMPLETE]} "
            f"complete, {by[TrialState.PRUNED]} pruned, {len(done) - sum(by.values())} failed), "
            f"{running} running"
        )
        if by[TrialState.COMPLETE]:
            best = study.best_trial
            values = ", ".join(
                f"{k.rsplit('.', 1)[-1]}={v:.4g}" if isinstance(v, float)
                else f"{k.rsplit('.', 1)[-1]}={v}"
                for k, v in best.user_attrs.get("values", best.params).items()
            )  # fmt: skip
            line += f"; best so far: trial {best.number}, {monitor} {best.value:.4f} ({values})"
        lines.append(line)
    print("\n".join(lines))
    return lines


def retrain_args(args: argparse.Namespace, best: dict[str, Any]) -> argparse.Namespace:
    """``reproduce_rec``'s arguments for the retraining of one twin's best values."""
    from bft_lightning.tuning.space import to_override

    out = copy.copy(args)
    values = [to_override(k, v) for k, v in best["values"].items()]
    extra = [o for o in shared_overrides(args) if "max_epochs" not in o and "data_root" not in o
             and "loss_normalization" not in o and "accelerator" not in o]  # fmt: skip
    out.override = extra + values  # run_one adds epochs, data root, normalization itself
    out.base_config = best.get("fit_config")
    out.tag = "tuned"
    return out


def setting_name(args: argparse.Namespace) -> str:
    """The comparison's name: ``<dataset>_<backbone>[_<space>][_noise<pct>]``."""
    return tuned_name(args.dataset, args.backbone, _space(args), args.noise)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--dataset", default="beauty", help="a configs/experiments/<backbone>_*_<dataset>.yaml"
    )
    p.add_argument("--backbone", default="sasrec", choices=["sasrec", "bert4rec", "hstu"])
    p.add_argument("--trials", type=int, default=24, help="each study's budget")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="retraining seeds")
    p.add_argument("--pruner", default="median", choices=["median", "asha", "hyperband", "none"])
    p.add_argument(
        "--prune-after", type=int, default=None, metavar="EPOCHS",
        help="tune's: no trial is pruned before this epoch (default: a tenth of max epochs)",
    )  # fmt: skip
    p.add_argument("--sampler-seed", type=int, default=0)
    p.add_argument("--max-epochs", type=int, default=200)
    p.add_argument("--data-root", default="../shared/data", help="relative to the repository")
    p.add_argument("--results-dir", default=str(Path("results") / "rec"))
    p.add_argument("--storage-dir", default=None, help="default: <results-dir>/tune")
    p.add_argument("--runs-dir", default=str(Path("logs") / "tune_twins"))
    p.add_argument("--jobs", type=int, default=1, help="tune workers per study (processes)")
    p.add_argument(
        "--noise", type=float, default=0.0,
        help="the data's train_noise in the retrainings of both twins (each at the setting "
        "its study chose on the clean data)",
    )  # fmt: skip
    p.add_argument(
        "--space", default=None,
        help="search spaces configs/search/<space>_<off|on>.yaml (default: the backbone's)",
    )  # fmt: skip
    p.add_argument("--accelerator", default=None)
    p.add_argument(
        "--loss-normalization", choices=["targets", "rows"], default="targets",
        help="as reproduce_rec.py's (its tables use 'targets')",
    )  # fmt: skip
    p.add_argument(
        "--override", action="append", default=[],
        help="a fit option for both studies and every retraining, as --override=--data.x=1",
    )  # fmt: skip
    p.add_argument(
        "--study-only", choices=list(TWINS), default=None,
        help="run (or continue) only this twin's study, then stop: two processes, one per "
        "twin, search both at once; a later run without it retrains and compares",
    )  # fmt: skip
    p.add_argument(
        "--retrain-only", choices=list(TWINS), default=None,
        help="retrain only this twin's choice (its study finished or continued first), then "
        "stop: two processes, one per twin, retrain both at once; a later run without it "
        "finds every seed done and compares",
    )  # fmt: skip
    p.add_argument(
        "--status", action="store_true",
        help="run nothing: each twin's study so far (trials finished of the budget, best so "
        "far) from its storage, and its trials.md/.csv rewritten there",
    )  # fmt: skip
    args = p.parse_args()
    if args.study_only and args.retrain_only:
        p.error("--study-only and --retrain-only: give one")
    os.chdir(ROOT)  # every default path, and each study's stored arguments, from here
    args.storage_dir = args.storage_dir or str(Path(args.results_dir) / "tune")
    args.space = args.space or args.backbone
    threads = os.environ.get("OMP_NUM_THREADS")
    args.command = (
        "OMP_WAIT_POLICY=PASSIVE " + (f"OMP_NUM_THREADS={threads} " if threads else "")
        + "python bench/tune_twins.py " + " ".join(sys.argv[1:])
    )  # fmt: skip
    if args.status:
        status(args)
        return
    if args.study_only:
        run_study(args, args.study_only)
        return
    twins = [args.retrain_only] if args.retrain_only else list(TWINS)
    best = {twin: run_study(args, twin) for twin in twins}
    base = Path(args.runs_dir) / f"{setting_name(args)}_t{args.trials}"
    for seed in args.seeds:
        for twin in twins:
            variant = TWINS[twin]
            out = base / f"{variant}_s{seed}"
            out.mkdir(parents=True, exist_ok=True)
            rr.run_one(retrain_args(args, best[twin]), variant, seed, out)
    if args.retrain_only:
        return
    runs = rr.load_runs(base, list(TWINS.values()), Path(args.results_dir))
    report(args, best, runs)


def report(args: argparse.Namespace, best: dict[str, dict], runs: dict) -> None:
    """The paired table (reproduce_rec's), the studies' best trials, and summary rows."""
    res = Path(args.results_dir)
    out = res / "tuned" / setting_name(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    shown = copy.copy(args)
    shown.tag = f"tuned, {args.trials} trials a twin" + (
        f", {round(100 * args.noise)}% training noise" if args.noise else ""
    )
    rows = []
    for protocol, protocol_runs in rr.by_protocol(runs).items():
        for row in rr.summarise(shown, protocol_runs, sorted(args.seeds), res):
            rows.append({**row, "protocol": protocol})
    rr.write_markdown(shown, rows, out.with_suffix(".md"))
    first = [r for r in rows if r["protocol"] == rows[0]["protocol"]]
    title = f"{args.backbone} on {args.dataset}, tuned twins" + rr.protocol_note(first)
    rr.plot(first, out.with_suffix(".png"), title)
    studies = ["", "## The studies", "",
               f"Each twin searched its space with TPE (sampler seed {args.sampler_seed}), "
               f"{args.trials} trials, pruner {args.pruner}; the best trial's values were "
               "retrained with the seeds above.", "",
               "| twin | study (storage) | best trial | best validation | values |",
               "|---|---|---|---|---|"]  # fmt: skip
    for twin, b in best.items():
        values = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in b["values"].items())
        studies.append(
            f"| {twin} | {b['study']} (`{b['storage']}`) | {b['trial']} | "
            f"{b['monitor']} {b['value']:.4f} | {values} |"
        )
    studies += ["", f"This table: `{args.command}`. It trains only seeds missing from both the "
                f"runs folder and `{res / 'runs'}/`, so with the committed runs and study "
                "databases it rebuilds the table without training."]  # fmt: skip
    text = out.with_suffix(".md").read_text() + "\n".join(studies) + "\n"
    write_text_atomic(out.with_suffix(".md"), text)
    summary_rows = []
    for row in rows:
        twin = "off" if row["variant"] == "off" else "on"
        summary = summary_row(
            row, tag=f"tuned/{setting_name(args)}", variant=twin, tuned=True,
            protocol=row["protocol"],
            noise=float(args.noise), chosen_by=f"{best[twin]['monitor']} (best of "
            f"{args.trials} trials, TPE seed {args.sampler_seed}, pruner {args.pruner})",
            trials=args.trials, setting=best[twin]["values"], study=best[twin]["study"],
        )  # fmt: skip
        summary_rows.append(summary)
    chosen = {  # the stored config is in each retraining's archived config.yaml
        twin: {**{k: v for k, v in b.items() if k != "fit_config"},
               "retrained_from": "the study's config" if b.get("fit_config") else "the files"}
        for twin, b in best.items()
    }  # fmt: skip
    doc = {"command": args.command, "studies": chosen, "rows": rows,
           "summary_rows": summary_rows}  # fmt: skip
    write_text_atomic(out.with_suffix(".json"), json.dumps(doc, indent=1, default=str))
    write_summary(res)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
