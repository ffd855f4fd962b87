"""Dependencies point one way: nn <- models <- tasks <- serving <- cli.

Each package is imported in a fresh interpreter, in that order; after each
import none of the packages above it may have been imported (a module that
reaches up, even lazily at import time, would show here). The source of
``serving`` must not name ``bft_lightning.cli`` at all, not even inside a
function: the command line hands serving what it needs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ORDER = ["nn", "models", "tasks", "serving", "cli"]
PACKAGE = Path(__file__).resolve().parents[1] / "bft_lightning"

PROBE = """
import importlib, json, sys
order = %r
seen = {}
for i, name in enumerate(order):
    importlib.import_module("bft_lightning." + name)
    above = [n for n in order[i + 1:]
             if any(m == "bft_lightning." + n or m.startswith("bft_lightning." + n + ".")
                    for m in sys.modules)]
    seen[name] = above
print(json.dumps(seen))
"""


def test_importing_each_layer_never_imports_one_above_it():
    out = subprocess.run(
        [sys.executable, "-c", PROBE % (ORDER,)], capture_output=True, text=True, check=True
    )
    above = json.loads(out.stdout.strip().splitlines()[-1])
    assert above == {name: [] for name in ORDER}


def test_serving_never_names_the_cli():
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in sorted((PACKAGE / "serving").rglob("*.py"))
        if "bft_lightning.cli" in p.read_text(encoding="utf-8")
        or "from ..cli" in p.read_text(encoding="utf-8")
    ]
    assert offenders == []


def test_the_checkpoint_key_is_spelled_once():
    key = re.compile(r'(get\(|\[|KEY\w* = )"bft_lightning"')
    spelled = [
        str(p.relative_to(PACKAGE))
        for p in sorted(PACKAGE.rglob("*.py"))
        if key.search(p.read_text(encoding="utf-8"))
    ]
    assert spelled == ["utils/checkpoint_format.py"]
