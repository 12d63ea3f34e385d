"""The repository stands alone: no reference to files a user does not have, no path of one machine.

Sources, docs, tests, experiments (results included), benchmarks and scripts cite the project's own
specification (docs/spec.md §N) and papers / projects by their public names, never a design note or a
reference file outside the checkout, and never an absolute path of the machine a run happened on.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["src", "docs", "tests", "experiments", "benchmarks", "scripts", "README.md"]
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}

# What a user cannot follow: notes that live outside the repository, and absolute paths of one machine.
FORBIDDEN = re.compile(
    r"SPEC §|SPEC\.md|shared/|(?i:seed 00\d)|verl\.md §|reference/verl\.md|(?:papers|peers)\.md|/work/|/root/|/home/"
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # markdown links [text](target)


def text_files(root: Path = ROOT) -> list[Path]:
    """Every UTF-8 text file under the scanned folders (binaries such as weights and images are skipped)."""
    out = []
    for name in SCANNED:
        top = root / name
        paths = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for path in paths:
            parts = path.relative_to(root).parts
            if SKIP_DIRS.intersection(parts) or any(part.endswith(".egg-info") for part in parts):
                continue
            try:
                path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            out.append(path)
    return out


def offending_lines(path: Path) -> list[str]:
    """``path:line: text`` for every line of ``path`` that refers to something outside the repository."""
    text = path.read_text(encoding="utf-8")
    if not FORBIDDEN.search(text):  # one pass over the whole file; lines only when something is there
        return []
    lines = text.splitlines()
    return [f"{path}:{i}: {line.strip()[:160]}" for i, line in enumerate(lines, 1) if FORBIDDEN.search(line)]


def test_scanner_catches_each_forbidden_reference(tmp_path):
    samples = [
        "see SPEC §3",
        "the ABEJA Seed 000 table",
        "from shared/reference/verl_vectors.json",
        "(verl.md §2.2)",
        "papers.md §7",
        "128 responses from /work/main/src/x.jsonl",
        "/root/.cache/x",
        "/home/me/model",
    ]
    f = tmp_path / "doc.md"
    f.write_text("\n".join(["docs/spec.md §3 is fine", *samples, "seed 0 of 3 is fine"]) + "\n")
    assert [line.split(": ", 1)[1] for line in offending_lines(f)] == samples


def test_no_reference_outside_the_repository():
    this = Path(__file__).resolve()
    files = [p for p in text_files() if p.resolve() != this]
    assert any(p.name == "spec.md" for p in files) and any(p.suffix == ".py" for p in files)
    bad = [hit for p in files for hit in offending_lines(p)]
    assert not bad, (
        "references a user cannot follow (cite docs/spec.md §N or a public source):\n" + "\n".join(bad[:40])
    )


def test_markdown_links_point_into_the_repository():
    """Every relative link in README.md and docs/ names a file or folder that exists in the checkout."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} → {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_spec_sections_cited_in_the_code_exist():
    """A citation "spec §N" (or "docs/spec.md §N") names a numbered section of docs/spec.md."""
    spec = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", spec, flags=re.MULTILINE)}
    assert sections == set(range(1, max(sections) + 1))
    cited = set()
    for path in text_files():
        for group in re.findall(r"spec(?:\.md)?\]?(?:\([^)]*\))? ((?:§\d+(?:[–-]\d+)?(?:, )?)+)",
                                path.read_text(encoding="utf-8"), flags=re.IGNORECASE):
            for a, b in re.findall(r"§(\d+)(?:[–-](\d+))?", group):
                cited.update(range(int(a), int(b or a) + 1))
    assert cited, "no spec citation found: the pattern is wrong"
    assert cited <= sections, f"cited sections missing from docs/spec.md: {sorted(cited - sections)}"
