"""Unpack what the GPU scripts sent back into ``results/`` (one command for all three).

    python bench/gpu/unpack.py <folder the device run's files came back to>

Each archive the folder holds is handled by its name:

- ``fast_path.tar.gz`` (``bench/gpu/fast_path.sh``): its tables become the marked
  section at the top of ``results/perf/cuda.md`` (replaced by a later unpack, the rest
  of the page kept), its raw rows ``results/perf/cuda_fast_path.json``;
- ``lm_study.tar.gz`` (``bench/gpu/lm_study.sh``): the runs join
  ``results/lm/gpu/synthetic_runs`` (the CPU study in ``results/lm`` is left alone) and
  the report (``results/lm/gpu/summary.json``, tables, plot) is written again from all
  of them;
- ``campaign.tar.gz`` (``bench/gpu/campaign.sh``): the studies and tuned tables join
  ``results/rec``, the retrainings' summaries and ranks ``logs/tune_twins`` (where
  ``bench/tune_twins.py`` looks for them), and ``results/rec/summary.json`` is
  rewritten.

Archives from a CPU check (``BFT_GPU_TINY=1``) are refused unless ``--root`` names
another tree than this repository.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- bench/gpu/fast_path.sh: begin -->", "<!-- bench/gpu/fast_path.sh: end -->"


def _extract(archive: Path, into: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def _merge(src: Path, dest: Path) -> list[Path]:
    """Copy every file under ``src`` to the same place under ``dest``."""
    copied = []
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        target = dest / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        copied.append(target)
    return copied


def _check_tiny(manifest: dict, root: Path, archive: Path) -> None:
    if manifest.get("tiny") and root.resolve() == ROOT:
        why = "comes from a CPU check (BFT_GPU_TINY=1): not unpacked into this repository's"
        print(f"{archive} {why} results (pass --root to unpack it elsewhere)", file=sys.stderr)
        raise SystemExit(2)


def fast_path(archive: Path, root: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = _extract(archive, Path(tmp)) / "fast_path"
        manifest = json.loads((src / "manifest.json").read_text())
        _check_tiny(manifest, root, archive)
        versions = (src / "versions.txt").read_text().strip().splitlines()
        gpu = next((v for v in versions if v.startswith("GPU:")), "GPU: unknown")
        parts = [(src / f"{m}.md").read_text().strip() for m in ("eager", "compiled")
                 if (src / f"{m}.md").is_file()]  # fmt: skip
        tables = "\n\n".join(_demote(p) for p in parts) or "(no table: see the log)"
        section = "\n".join([
            BEGIN, f"## The fused kernel's fast path, {gpu.removeprefix('GPU: ')}", "",
            "Measured by `bash bench/gpu/fast_path.sh` on the device machine (it runs "
            "`bench/cuda_fast_path.py`, eager then compiled, each ratio against the off "
            "twin measured in the same call); unpacked by `python bench/gpu/unpack.py`. "
            "Versions: " + "; ".join(versions[1:]), "", tables, END,
        ])  # fmt: skip
        rows = {m: json.loads((src / f"{m}.json").read_text())
                for m in ("eager", "compiled") if (src / f"{m}.json").is_file()}  # fmt: skip
    perf = root / "results" / "perf"
    perf.mkdir(parents=True, exist_ok=True)
    page = perf / "cuda.md"
    text = page.read_text() if page.is_file() else "# Performance on CUDA\n"
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        text = before + section + rest.split(END, 1)[1]
    else:
        title, _, body = text.partition("\n")
        text = f"{title}\n\n{section}\n{body}"
    page.write_text(text)
    (perf / "cuda_fast_path.json").write_text(json.dumps(rows, indent=1) + "\n")
    return f"{page} (section), {perf / 'cuda_fast_path.json'}"


def _demote(markdown: str) -> str:
    """The script's own headings one level down, under the section's; its first line
    (the versions, given once above) dropped."""
    lines = markdown.splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join("#" + x if x.startswith("#") else x for x in lines).strip()


def lm_study(archive: Path, root: Path) -> str:
    dest = root / "results" / "lm" / "gpu"
    with tempfile.TemporaryDirectory() as tmp:
        src = _extract(archive, Path(tmp)) / "lm_study"
        _check_tiny(json.loads((src / "manifest.json").read_text()), root, archive)
        _merge(src, dest)
    sys.path.insert(0, str(ROOT / "bench"))
    import lm_synthetic

    rows = lm_synthetic.report(dest)
    return f"{dest} ({len(list((dest / 'synthetic_runs').glob('*.json')))} runs, {len(rows)} rows)"


def campaign(archive: Path, root: Path) -> str:
    res = root / "results" / "rec"
    with tempfile.TemporaryDirectory() as tmp:
        src = _extract(archive, Path(tmp)) / "campaign"
        manifest = json.loads((src / "manifest.json").read_text())
        _check_tiny(manifest, root, archive)
        rec = _merge(src / "rec", res) if (src / "rec").is_dir() else []
        runs = _merge(src / "runs", root / "logs" / "tune_twins") if (src / "runs").is_dir() else []
    sys.path.insert(0, str(ROOT / "bench"))
    from common.tables import write_summary

    write_summary(res)
    done = manifest.get("finished") or "none"
    return f"{len(rec)} files into {res}, {len(runs)} run files; steps finished: {done}"


HANDLERS = {"fast_path.tar.gz": fast_path, "lm_study.tar.gz": lm_study,
            "campaign.tar.gz": campaign}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("folder", type=Path, help="where the device run's files came back")
    p.add_argument("--root", type=Path, default=ROOT, help="the tree to unpack into")
    args = p.parse_args()
    found = {name: sorted(args.folder.rglob(name)) for name in HANDLERS}
    if not any(found.values()):
        raise SystemExit(f"no {', '.join(HANDLERS)} under {args.folder}")
    for name, archives in found.items():
        for archive in archives:
            print(f"{name}: {HANDLERS[name](archive, args.root)}")


if __name__ == "__main__":
    main()
