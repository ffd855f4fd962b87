"""Copy the datasets a GPU script needs into the tree's ignored carry folder.

The GPU machine runs on a copy of the working tree without ``../shared``, so the
interaction files travel inside the tree, in ``.gpu_carry/data/<folder>/`` (ignored by
git; name ``.gpu_carry`` in the run's ``carry`` list). Each dataset is named by its
``configs/data/<name>.yaml`` (``beauty``, ``sports``, ...) or by its folder under the
data root (``amazon-beauty-s3rec``); only the interaction file and its provenance are
copied (the attribute files are not read by training).

    python bench/gpu/stage_data.py beauty sports           # from ../shared/data
    python bench/gpu/stage_data.py --campaign              # every dataset of campaign.txt
    python bench/gpu/stage_data.py --wheels                # the packages the image lacks

``--wheels`` downloads (pip, here) the wheels of ``device-requirements.txt`` for the GPU
machine's CPython 3.12 into ``.gpu_carry/wheels``; the scripts install them there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
CARRY = ROOT / ".gpu_carry"
DEST = CARRY / "data"
WHEELS = CARRY / "wheels"
REQUIREMENTS = Path(__file__).with_name("device-requirements.txt")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def source_root() -> Path:
    """``$BFT_SHARED_DATA``; else ``../shared/data`` beside the repository where it
    exists; else ``$BFT_DATA_ROOT``."""
    if "BFT_SHARED_DATA" in os.environ:
        return Path(os.environ["BFT_SHARED_DATA"])
    beside = ROOT.parent / "shared" / "data"
    return beside if beside.is_dir() else Path(os.environ.get("BFT_DATA_ROOT", beside))


def folder_of(name: str) -> str:
    """The data-root folder of ``name``: a ``configs/data`` config's ``dataset:``, or itself."""
    config = ROOT / "configs" / "data" / f"{name}.yaml"
    if config.is_file():
        for line in config.read_text().splitlines():
            key, _, value = line.strip().partition(":")
            if key == "dataset" and value.strip():
                return value.strip()
    return name


def stage(names: list[str], source: Path, dest: Path = DEST) -> list[Path]:
    """Copy each dataset's interaction file (and PROVENANCE.md) to ``dest/<folder>/``."""
    from bft_lightning.datamodules.registry import KNOWN_DATASETS

    copied = []
    folders = {folder_of(name): name for name in reversed(names)}  # one copy per folder
    for folder, name in reversed(folders.items()):
        if folder == "synthetic":  # generated in memory: nothing to carry
            continue
        src = source / folder
        if not src.is_dir():
            raise SystemExit(f"stage_data: no dataset folder {src} (for {name!r})")
        spec = KNOWN_DATASETS.get(folder)
        wanted = [spec.filename, "PROVENANCE.md"] if spec else [p.name for p in src.iterdir()]
        if spec and not (src / spec.filename).is_file():
            raise SystemExit(f"stage_data: {src / spec.filename} is missing")
        (dest / folder).mkdir(parents=True, exist_ok=True)
        for file in wanted:
            if (src / file).is_file():
                shutil.copy2(src / file, dest / folder / file)
                copied.append(dest / folder / file)
    return copied


def wheels(dest: Path = WHEELS) -> list[Path]:
    """The device-requirements.txt wheels for CPython 3.12 on x86-64 Linux, into ``dest``."""
    platforms = [x for p in PLATFORMS for x in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", *platforms,
           "-d", str(dest), "-r", str(REQUIREMENTS)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return sorted(dest.glob("*.whl"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("names", nargs="*", help="configs/data names or data-root folders")
    p.add_argument("--campaign", action="store_true", help="every dataset of campaign.txt")
    p.add_argument("--source", type=Path, default=None, help="default: ../shared/data")
    p.add_argument("--dest", type=Path, default=DEST)
    p.add_argument("--wheels", action="store_true", help="also the wheels (pip download)")
    args = p.parse_args()
    names = list(args.names)
    if args.campaign:
        import campaign

        names += [s.dataset for s in campaign.read_steps(campaign.CAMPAIGN)]
    if args.wheels:
        got = wheels()
        size = sum(f.stat().st_size for f in got) / 2**20
        print(f"{len(got)} wheels ({size:.1f} MiB) under {WHEELS}")
    if not names:
        if args.wheels:
            return
        p.error("name at least one dataset, or --campaign (or --wheels)")
    files = stage(names, args.source or source_root(), args.dest)
    size = sum(f.stat().st_size for f in files)
    print(f"staged {len(files)} files ({size / 2**20:.1f} MiB) under {args.dest}")


if __name__ == "__main__":
    main()
