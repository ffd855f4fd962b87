"""bench/gpu: the three GPU scripts, their data staging, the campaign's next step, and
the unpack of what they send back (synthetic archives shaped like theirs); the scripts
themselves end to end on a CPU at tiny sizes (slow)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"
sys.path.insert(0, str(GPU))
sys.path.insert(0, str(GPU.parent))  # tune_twins, lm_synthetic: sibling scripts
import campaign  # noqa: E402
import stage_data  # noqa: E402
import unpack  # noqa: E402

SCRIPTS = ["fast_path.sh", "lm_study.sh", "campaign.sh", "env.sh"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_syntax(script: str) -> None:
    done = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _fake_shared(tmp: Path) -> Path:
    src = tmp / "shared"
    beauty = src / "amazon-beauty-s3rec"
    beauty.mkdir(parents=True)
    (beauty / "Beauty.txt").write_text("1 1 2 3\n2 2 3 4\n")
    (beauty / "PROVENANCE.md").write_text("where it came from\n")
    (beauty / "Beauty_item2attributes.json").write_text("{}")
    return src


def test_stage_copies_the_interaction_files_by_config_name(tmp_path: Path) -> None:
    dest = tmp_path / "carry" / "data"
    names = ["beauty", "amazon-beauty-s3rec", "synthetic"]  # one folder, and none
    files = stage_data.stage(names, _fake_shared(tmp_path), dest)
    assert sorted(f.relative_to(dest).as_posix() for f in files) == [
        "amazon-beauty-s3rec/Beauty.txt", "amazon-beauty-s3rec/PROVENANCE.md",
    ]  # fmt: skip
    assert (dest / "amazon-beauty-s3rec" / "Beauty.txt").read_text() == "1 1 2 3\n2 2 3 4\n"
    with pytest.raises(SystemExit, match="no dataset folder .*amazon-sports-s3rec"):
        stage_data.stage(["sports"], tmp_path / "shared", dest)


def test_the_carry_folder_is_ignored_by_git() -> None:
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    for path in (".gpu_carry/data/amazon-beauty-s3rec/Beauty.txt", ".gpu_venv/bin/python"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert done.returncode == 0, path
    assert stage_data.DEST == ROOT / ".gpu_carry" / "data"


def test_campaign_steps_and_names_match_tune_twins() -> None:
    import tune_twins as tt

    steps = campaign.read_steps(GPU / "campaign.txt")
    assert [s.name for s in steps[:3]] == [
        "beauty_sasrec_sasrec_ss256", "beauty_sasrec_sasrec_ss256_noise30",
        "lastfm_sasrec_sasrec_ss256",
    ]  # fmt: skip
    assert steps[-1] == campaign.Step("instruments", "hstu", 0.0, "hstu")
    for s in steps:
        args = tt.argparse.Namespace(dataset=s.dataset, backbone=s.backbone, space=s.space,
                                     noise=s.noise)  # fmt: skip
        assert tt.setting_name(args) == s.name
        # every step's experiment configs exist
        for twin in ("off", "on"):
            assert (tt.EXPERIMENTS / f"{s.backbone}_{twin}_{s.dataset}.yaml").is_file()


def _tuned(res: Path, name: str, seeds: list[int]) -> None:
    (res / "tuned").mkdir(parents=True, exist_ok=True)
    rows = [{"dataset": name.split("_")[0], "variant": v, "seeds": seeds, "tag": f"tuned/{name}"}
            for v in ("off", "on")]  # fmt: skip
    (res / "tuned" / f"{name}.json").write_text(json.dumps({"summary_rows": rows}))


def test_next_pending_step_needs_every_seed(tmp_path: Path) -> None:
    steps = campaign.read_steps(GPU / "campaign.txt")
    res = tmp_path / "rec"
    assert campaign.next_pending(steps, [0, 1, 2], res) == steps[0]
    _tuned(res, steps[0].name, [0, 1])  # a step cut short: one seed missing
    assert campaign.next_pending(steps, [0, 1, 2], res) == steps[0]
    _tuned(res, steps[0].name, [0, 1, 2])
    _tuned(res, steps[2].name, [0, 1, 2])  # a later step done out of order is skipped
    assert campaign.next_pending(steps, [0, 1, 2], res) == steps[1]
    for s in steps:
        _tuned(res, s.name, [0, 1, 2])
    assert campaign.next_pending(steps, [0, 1, 2], res) is None


@pytest.mark.parametrize(
    ("line", "message"),
    [("beauty sasrec", "expected 'dataset backbone noise"), ("beauty gru 0", "backbone 'gru'"),
     ("beauty sasrec x", "noise 'x'"), ("beauty sasrec 0 nope", "no search space")],
)  # fmt: skip
def test_a_bad_campaign_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "campaign.txt"
    path.write_text(f"# order\nbeauty sasrec 0.0\n{line}\n")
    with pytest.raises(SystemExit, match=f"campaign.txt:3: {message}"):
        campaign.read_steps(path)


def _write(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_campaign_pack_then_unpack_rewrites_the_summary(tmp_path: Path) -> None:
    gpu, here = tmp_path / "gpu", tmp_path / "here"
    res, runs = gpu / "results" / "rec", gpu / "logs" / "tune_twins"
    _write(res / "tuned" / "old_sasrec.json", "{}")  # before the run: not packed
    marker = _write(tmp_path / "marker")
    past = time.time() - 60
    os.utime(res / "tuned" / "old_sasrec.json", (past, past))
    os.utime(marker, (past + 1, past + 1))
    _tuned(res, "beauty_sasrec_sasrec_ss256", [0, 1, 2])
    _write(res / "tune" / "beauty_sasrec_sasrec_ss256_off.db", "sqlite")
    _write(res / "summary.json", "[]")
    run = runs / "beauty_sasrec_sasrec_ss256_t24" / "off_s0"
    _write(run / "summary.json", "{}")
    _write(run / "ranks.npy", "ranks")
    _write(run / "tb" / "version_0" / "checkpoints" / "best.ckpt")  # checkpoints stay
    _write(runs / "tune" / "trials" / "version_3" / "events")  # the trials' folders stay
    archive = tmp_path / "out" / "campaign.tar.gz"
    names = campaign.pack(marker.stat().st_mtime, archive, {"finished": "beauty"}, res, runs)
    assert sorted(names) == [
        "rec/tune/beauty_sasrec_sasrec_ss256_off.db", "rec/tuned/beauty_sasrec_sasrec_ss256.json",
        "runs/beauty_sasrec_sasrec_ss256_t24/off_s0/ranks.npy",
        "runs/beauty_sasrec_sasrec_ss256_t24/off_s0/summary.json",
    ]  # fmt: skip
    _tuned(here / "results" / "rec", "toys_sasrec", [0])  # a row already in the tree
    done = subprocess.run([sys.executable, str(GPU / "unpack.py"), str(archive.parent),
                           "--root", str(here)], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (here / "results" / "rec" / "tune" / "beauty_sasrec_sasrec_ss256_off.db").is_file()
    assert (here / "logs" / "tune_twins" / "beauty_sasrec_sasrec_ss256_t24" / "off_s0"
            / "ranks.npy").read_text() == "ranks"  # fmt: skip
    summary = json.loads((here / "results" / "rec" / "summary.json").read_text())
    assert sorted({r["tag"] for r in summary}) == ["tuned/beauty_sasrec_sasrec_ss256",
                                                    "tuned/toys_sasrec"]  # fmt: skip


def _tar(path: Path, files: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _fast_path_archive(folder: Path, ms: str, tiny: bool = False) -> Path:
    table = f"| 64, 200, 64, 2 | fused | 1.00 | {ms} | {ms} | 1.0 | 1.0 | 1.00 |"
    return _tar(folder / "fast_path.tar.gz", {
        "fast_path/manifest.json": json.dumps({"kind": "fast_path", "tiny": tiny}),
        "fast_path/versions.txt": "== fast_path\nNVIDIA H100, 570.1, 80 GiB\nGPU: NVIDIA H100\n",
        "fast_path/eager.md": f"# NVIDIA H100; torch\n\n## One encoder layer, eager\n\n{table}\n",
        "fast_path/eager.json": json.dumps({"tables": {"layer": [{"ms_on": float(ms)}]}}),
    })  # fmt: skip


def test_fast_path_unpack_keeps_one_section_and_the_page(tmp_path: Path) -> None:
    page = _write(tmp_path / "results" / "perf" / "cuda.md", "# Performance\n\nOlder tables.\n")
    for ms in ("1.25", "1.10"):  # a second run replaces the first one's section
        unpack.fast_path(_fast_path_archive(tmp_path / ms, ms), tmp_path)
    text = page.read_text()
    assert text.startswith("# Performance\n") and text.endswith("Older tables.\n")
    assert text.count(unpack.BEGIN) == 1 and "| 1.10 |" in text and "| 1.25 |" not in text
    assert "NVIDIA H100" in text and "### One encoder layer, eager" in text
    rows = json.loads((tmp_path / "results" / "perf" / "cuda_fast_path.json").read_text())
    assert rows["eager"]["tables"]["layer"][0]["ms_on"] == 1.10


def test_a_cpu_check_is_not_unpacked_into_the_repository(tmp_path: Path) -> None:
    _fast_path_archive(tmp_path, "2.0", tiny=True)
    done = subprocess.run([sys.executable, str(GPU / "unpack.py"), str(tmp_path)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2
    assert "comes from a CPU check (BFT_GPU_TINY=1)" in done.stderr


def _lm_run(method: str, noise: float, em: list[float]) -> dict:
    per_q = {f"q{i}": [v, v] for i, v in enumerate(em)}
    return {"name": f"{method}_np{noise:g}_k0_s0", "method": method, "noise_rate": noise,
            "distractors": 0, "seed": 0, "model": "d384", "noise_in_inputs": False,
            "test_em": sum(em) / len(em), "test_f1": sum(em) / len(em), "per_question": per_q,
            "fit_seconds": 3.0, "pretrain": {"params": 10_700_000}}  # fmt: skip


def test_lm_unpack_merges_runs_and_reports_params(tmp_path: Path) -> None:
    dest = tmp_path / "results" / "lm" / "gpu" / "synthetic_runs"
    _write(dest / "off_np0_k0_s0.json", json.dumps(_lm_run("off", 0.0, [1, 0, 0, 1])))
    bft = _lm_run("bft", 0.0, [1, 1, 0, 1])
    archive = _tar(tmp_path / "back" / "lm_study.tar.gz", {
        "lm_study/manifest.json": json.dumps({"kind": "lm_study", "tiny": False}),
        f"lm_study/synthetic_runs/{bft['name']}.json": json.dumps(bft),
    })  # fmt: skip
    unpack.lm_study(archive, tmp_path)
    rows = json.loads((dest.parent / "summary.json").read_text())
    assert [(r["method"], r["params"], r["model"]) for r in rows] == [
        ("off", 10_700_000, "d384"),
        ("bft", 10_700_000, "d384"),
    ]
    assert rows[1]["paired_delta_em"] == pytest.approx(0.25)
    assert "d384, 10,700,000 parameters" in (dest.parent / "synthetic_tables.md").read_text()


def test_the_lm_preset_has_5_to_30m_parameters() -> None:
    import lm_synthetic

    cfg = lm_synthetic.MODELS["d384"]
    d, f, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    params = n * (4 * d * d + 3 * d * f) + 2 * 284 * d  # attention, SwiGLU, embeddings: 10.8M
    assert 5e6 <= params <= 30e6


# ------------------------------------------------------------------ end to end, tiny, CPU
def _run(script: str, out: Path, **env: str) -> None:
    full = dict(os.environ, OUT=str(out), BFT_GPU_TINY="1", BFT_GPU_JOBS="2",
                OMP_NUM_THREADS="1", BFT_GPU_PYTHON=sys.executable, **env)  # fmt: skip
    done = subprocess.run(["bash", str(GPU / script)], env=full, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    log = (out / f"{Path(script).stem}.log").read_text()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert not re.search(r"stage \S+ (failed|ran out)", log), log[-3000:]
    assert "GPU: no CUDA device; python" in (out / "versions.txt").read_text()


def _unpack(out: Path, root: Path) -> None:
    done = subprocess.run([sys.executable, str(GPU / "unpack.py"), str(out), "--root", str(root)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_fast_path_script_tiny(tmp_path: Path) -> None:
    _run("fast_path.sh", tmp_path / "out")
    _unpack(tmp_path / "out", tmp_path)
    text = (tmp_path / "results" / "perf" / "cuda.md").read_text()
    for impl in ("chunked", "blockwise", "fused"):
        assert f"| 2, 50, 16, 2 | {impl} |" in text
    assert "| sasrec |" in text and "| hstu |" in text and "against the reference" in text


@pytest.mark.slow
def test_lm_study_script_tiny(tmp_path: Path) -> None:
    _run("lm_study.sh", tmp_path / "out", BFT_LM_MODEL="d128l2", BFT_LM_PRETRAIN_STEPS="4",
         BFT_LM_SFT_STEPS="2", BFT_LM_METHODS="off bft", BFT_LM_DISTRACTORS="0",
         BFT_LM_SEEDS="0")  # fmt: skip
    _unpack(tmp_path / "out", tmp_path)
    rows = json.loads((tmp_path / "results" / "lm" / "gpu" / "summary.json").read_text())
    assert {(r["method"], r["noise"]) for r in rows} == {
        (m, x) for m in ("off", "bft") for x in (0.0, 0.3)
    }
    assert all(r["params"] > 0 and r["model"] == "d128l2" for r in rows)


@pytest.mark.slow
def test_campaign_script_tiny(tmp_path: Path) -> None:
    steps = _write(tmp_path / "campaign.txt", "synthetic sasrec 0.0 sasrec\n")
    tiny = ("--override=--trainer.limit_train_batches=4 --override=--trainer.limit_val_batches=1 "
            "--override=--trainer.check_val_every_n_epoch=1 "
            "--override=--data.init_args.synthetic_users=600 "
            "--override=--data.init_args.synthetic_items=200")  # fmt: skip
    _run("campaign.sh", tmp_path / "out", BFT_GPU_CAMPAIGN=str(steps), BFT_CAMPAIGN_TRIALS="2",
         BFT_CAMPAIGN_SEEDS="0", BFT_CAMPAIGN_MAX_EPOCHS="1", BFT_CAMPAIGN_RETRAIN="2",
         BFT_CAMPAIGN_OVERRIDES=tiny)  # fmt: skip
    _unpack(tmp_path / "out", tmp_path)
    summary = json.loads((tmp_path / "results" / "rec" / "summary.json").read_text())
    assert {(r["variant"], tuple(r["seeds"])) for r in summary} == {("off", (0,)), ("on", (0,))}
    assert (tmp_path / "results" / "rec" / "tune" / "synthetic_sasrec_off.db").is_file()
    assert list((tmp_path / "logs" / "tune_twins").glob("synthetic_sasrec_t2/*_s0/ranks.npy"))


def _study_db(path: Path, config: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as db:
        db.execute("create table study_user_attributes (key text, value_json text)")
        meta = {"fit_args": ["--config", config, "--trainer.max_epochs=100"]}
        db.execute("insert into study_user_attributes values ('bft_tune', ?)", [json.dumps(meta)])


def test_a_step_started_from_another_checkout_is_left_to_it(tmp_path: Path) -> None:
    steps = campaign.read_steps(GPU / "campaign.txt")
    res = tmp_path / "rec"
    # beauty's clean study, made elsewhere: its noisy rows retrain that study's choice
    _study_db(res / "tune" / "beauty_sasrec_sasrec_ss256_on.db",
              "/elsewhere/configs/experiments/sasrec_on_beauty.yaml")  # fmt: skip
    _study_db(res / "tune" / "lastfm_sasrec_sasrec_ss256_off.db",
              str(ROOT / "configs" / "experiments" / "sasrec_off_lastfm.yaml"))  # fmt: skip
    assert campaign.started_elsewhere(steps[0], res) and campaign.started_elsewhere(steps[1], res)
    assert not campaign.started_elsewhere(steps[2], res)  # this checkout's: it continues
    assert campaign.next_pending(steps, [0, 1, 2], res) == steps[2]
