"""The library cites documents inside the repository only, and those documents exist.

``docs/spec.md`` is the reference for the filter math: library docstrings cite it (by
section), never a file outside the repository, and its list of tested properties
names test files that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "bft_lightning"
SPEC = REPO / "docs" / "spec.md"

# the development data root (``<repo>/../shared/data``) is a data location, not a document
DATA_ROOT = "../shared/data"
# what the spec was before it moved into the repository, and other out-of-repo paths
OUTSIDE = re.compile(r"BFT_SPEC|ARCHITECTURE\.md|ECOSYSTEM_NOTES|/work/|(?:\.\./)+(?!shared/data)")
DOC_PATH = re.compile(r"\b((?:docs|results)/[\w./-]*\w\.md)\b")
SECTION = re.compile(r"docs/spec\.md`*(?:, | \()([A-Z][\w ]*)")
TEST_PATH = re.compile(r"\btests/[\w/]+\.py\b")


def _package_texts() -> list[tuple[Path, str]]:
    files = [p for p in sorted(PACKAGE.rglob("*")) if p.is_file() and p.suffix != ".pyc"]
    texts = [(p, p.read_text(encoding="utf-8", errors="replace")) for p in files]
    assert len(texts) > 20, "the package's files were not found"
    return texts


def _headings() -> list[str]:
    lines = SPEC.read_text(encoding="utf-8").splitlines()
    return [line.lstrip("#").strip() for line in lines if line.startswith("#")]


def _properties_section() -> str:
    text = SPEC.read_text(encoding="utf-8")
    start = text.index("\n## Properties the tests check")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_no_file_of_the_package_cites_a_path_outside_the_repository() -> None:
    found = []
    for path, text in _package_texts():
        for n, line in enumerate(text.splitlines(), 1):
            for m in OUTSIDE.finditer(line.replace(DATA_ROOT, "")):
                found.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)!r} in {line.strip()!r}")
    assert not found, "out-of-repository citations:\n" + "\n".join(found)


def test_the_outside_pattern_catches_what_it_should() -> None:
    """The check above can fail: the old spec, absolute and relative outside paths."""
    for bad in ("see BFT_SPEC.md section 1", "/work/shared/x.md", "../shared/BFT.md", "../x"):
        assert OUTSIDE.search(bad.replace(DATA_ROOT, "")), bad
    for fine in ("``docs/spec.md``, Observe", "data_root: str = '../shared/data'"):
        assert not OUTSIDE.search(fine.replace(DATA_ROOT, "")), fine


def test_every_cited_document_exists() -> None:
    cited: dict[str, list[str]] = {}
    for path, text in _package_texts():
        for m in DOC_PATH.finditer(text):
            cited.setdefault(m.group(1), []).append(str(path.relative_to(REPO)))
    assert "docs/spec.md" in cited, "the library no longer cites docs/spec.md"
    missing = {doc: where for doc, where in cited.items() if not (REPO / doc).is_file()}
    assert not missing, f"cited documents that do not exist: {missing}"


def test_cited_sections_of_the_spec_exist() -> None:
    headings = _headings()
    cited = []
    for path, text in _package_texts():
        cited += [(path, m.group(1).strip()) for m in SECTION.finditer(text)]
    assert cited, "no section of docs/spec.md is cited"
    bad = [
        f"{path.relative_to(REPO)}: {name!r}"
        for path, name in cited
        if not any(h.startswith(name) for h in headings)
    ]
    assert not bad, f"sections cited that docs/spec.md does not have: {bad}"


def test_every_test_file_named_in_the_properties_section_exists() -> None:
    named = sorted(set(TEST_PATH.findall(_properties_section())))
    assert len(named) >= 10, f"the properties section names too few test files: {named}"
    missing = [name for name in named if not (REPO / name).is_file()]
    assert not missing, f"test files named in docs/spec.md that do not exist: {missing}"
    for name in named:
        assert re.search(r"^def test_", (REPO / name).read_text(), re.M), f"{name} has no test"
