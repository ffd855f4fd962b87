"""A QA example (a question, its answers, gold passages and distractors) and where the
datasets live (``DATASETS`` under the data root)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bft_lightning.datamodules.registry import default_data_root

REPO_ROOT = Path(__file__).resolve().parents[3]
DATASETS: dict[str, tuple[str, ...]] = {
    "squad": ("squad-dev/dev-v1.1.json",),
    "squad2": ("squad-dev/dev-v2.0.json",),
    "hotpotqa": (
        "hotpotqa-distractor/hotpot_dev_distractor_ircot_subsampled500.jsonl",
        "hotpotqa-distractor/hotpot_dev_distractor_reflexion_sample100.jsonl",
    ),
    "nq": ("nq-open-oracle/nq-open-oracle.jsonl.gz",),
    "rgb": ("rgb-en-fact/en_fact.json",),
}


def data_root(root: str | Path | None = None) -> Path:
    """``root`` when given, else ``$BFT_DATA_ROOT``, else ``data`` (under the working directory)."""
    if root is not None:
        return Path(root).expanduser()
    return default_data_root()


def resolve_data_file(path: str | Path, root: str | Path | None = None) -> Path:
    """``path`` if it exists, else under the data root (e.g. ``tinyshakespeare/input.txt``)."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return p
    return data_root(root) / p


@dataclass
class Passage:
    text: str
    title: str = ""
    gold: bool = True


@dataclass
class QAExample:
    """One question: gold passages first (``gold=True``), then the dataset's distractors."""

    id: str
    question: str
    answers: list[str]
    passages: list[Passage]
    group: str
    answer_start: int | None = None  # char offset of answers[0] in the first gold passage

    @property
    def gold(self) -> list[Passage]:
        return [p for p in self.passages if p.gold]

    @property
    def distractors(self) -> list[Passage]:
        return [p for p in self.passages if not p.gold]
