"""bench/reproduce_lm.py --checkpoint_dir: the paper's SFT protocol on a local Llama checkpoint.

A smoke test on CPU: a tiny random checkpoint in the Llama format (``config.json``
plus sharded ``*.safetensors``, written by ``transformers`` as TinyLlama ships,
and a ``tokenizer.json``) and a small SQuAD-format file; a few optimizer steps
per method, then EM/F1 on the held-out articles.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from lm_helpers import write_hf_checkpoint, write_squad_file

SCRIPT = Path(__file__).parents[2] / "bench" / "reproduce_lm.py"


def _load():
    spec = importlib.util.spec_from_file_location("reproduce_lm", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama_ckpt"), pad_token_id=3)


def test_checkpoint_protocol_runs_and_resumes(tmp_path: Path, checkpoint: Path):
    root = tmp_path / "data"
    (root / "squad-dev").mkdir(parents=True)
    write_squad_file(root / "squad-dev" / "dev-v1.1.json", articles=16)
    out = tmp_path / "out"
    argv = [
        "--checkpoint_dir",
        str(checkpoint),
        "--datasets",
        "squad",
        "--data-root",
        str(root),
        "--methods",
        "off",
        "bft",
        "label_smoothing",
        "--noise",
        "0.3",
        "--ckpt-distractors",
        "1",
        "--seeds",
        "0",
        "--max-steps",
        "3",
        "--batch-size",
        "4",
        "--accumulate",
        "1",
        "--max-length",
        "160",
        "--max-eval-examples",
        "8",
        "--warmup-steps",
        "0",
        "--lr",
        "1e-2",
        "--accelerator",
        "cpu",
        "--threads",
        "1",
        "--log-every",
        "1",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "work"),
    ]
    mod = _load()
    mod.main(argv)
    summary = json.loads((out / "checkpoint_summary.json").read_text())
    assert [r["method"] for r in summary] == ["off", "bft", "label_smoothing"]
    for r in summary:
        assert r["steps"] == 3 and r["device"] == "cpu"
        assert 0.0 <= r["test_em"] <= r["test_f1"] + 1e-9 <= 1.0 + 1e-9
        assert (r["noise_rate"], r["distractors"], r["dataset"]) == (0.3, 1, "squad")
        run = json.loads((out / "checkpoint_runs" / f"{r['name']}.json").read_text())
        assert len(run["per_question"]) == 8  # every held-out question scored
        assert len(run["train_loss_trace"]) == 3
        assert all(math.isfinite(x) for x in run["train_loss_trace"])
    # a finished run is not retrained
    stamp = (out / "checkpoint_runs" / "squad_off_np0.3_k1_s0.json").stat().st_mtime_ns
    mod.main(argv)
    assert (out / "checkpoint_runs" / "squad_off_np0.3_k1_s0.json").stat().st_mtime_ns == stamp


def test_checkpoint_protocol_rejects_cpu_only_methods(tmp_path: Path, checkpoint: Path):
    mod = _load()
    with pytest.raises(SystemExit, match="sft"):
        mod.main(["--checkpoint_dir", str(checkpoint), "--methods", "sft", "--out", str(tmp_path)])
