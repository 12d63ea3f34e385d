"""docs/architecture.md, checked. The rule: every module of the repository — under src/rollcorr, and the studies,
benchmarks and scripts that use it (experiments/, benchmarks/, scripts/: the bottom floor) — sits on one floor
(``LAYERS``) and imports only from its own floor or the floors above it (0 imports the wrong way); the tools,
side by side on their floor, import nothing of each other; and nothing imports in a circle, neither modules nor
the parts that ``LAYERS`` names (an app, a package, a module of its own).

Every import counts, at any depth of the code: at the top of a module, inside functions (a lazy import is a
dependency all the same) and under ``if TYPE_CHECKING:`` (an annotation is a dependency). The imports are read
with ``ast`` (nothing is imported). An import of a package is an edge to its ``__init__``; ``from package
import name`` is an edge to ``package.name`` when that is a module, else to the package.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tokenize
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "rollcorr"
STUDIES = ("experiments", "benchmarks", "scripts")  # folders of the repository that use rollcorr as a user does
SCRIPT_FOLDERS = ("benchmarks", "scripts")  # run as scripts from their folder: `import machine` is a sibling

# docs/architecture.md, "Layers", top to bottom: a module imports only from its own floor or the floors above.
# An entry holds the module of that name and every module below it, except the root "rollcorr" (its
# __init__ only: the version).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaf", ("rollcorr", "rollcorr.rollout", "rollcorr.config.correction", "rollcorr.config.loss",
              "rollcorr.config.yaml_io", "rollcorr.safe_io", "rollcorr.user_code", "rollcorr.plugins")),
    ("math", ("rollcorr.correction", "rollcorr.losses", "rollcorr.advantages", "rollcorr.logprobs",
              "rollcorr.shards")),
    ("config", ("rollcorr.config",)),
    ("engines", ("rollcorr.engines", "rollcorr.models", "rollcorr.tasks", "rollcorr.envs", "rollcorr.moe")),
    ("proximal", ("rollcorr.proximal",)),
    # rollcorr.checkpoint: the checkpoint home that train and distributed share
    ("services", ("rollcorr.dumps", "rollcorr.turns", "rollcorr.chunked", "rollcorr.plotting", "rollcorr.distributed",
                  "rollcorr.checkpoint")),
    ("train", ("rollcorr.train",)),
    ("tools", ("rollcorr.audit", "rollcorr.analyze", "rollcorr.compat", "rollcorr.convert")),
    ("command", ("rollcorr.cli", "rollcorr.__main__")),
    ("studies", STUDIES),
]
SIDE_BY_SIDE = "tools"  # the floor whose entries import nothing of each other

# Wrong-way imports known today, each with what removes it; delete an entry when its import is gone (a test
# below says when). None today.
PENDING: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC if path.is_relative_to(SRC) else ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in [*PACKAGE.rglob("*.py"), *(p for d in STUDIES for p in (ROOT / d).rglob("*.py"))]}


def imports_of(name: str) -> set[str]:
    """Every rollcorr module ``name`` imports, at any depth of its code."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    sibling = package + "." if package in SCRIPT_FOLDERS else ""  # `from machine import load` in benchmarks/
    out: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # every node: function bodies and `if TYPE_CHECKING:` blocks included
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = [
                f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in MODULES
            ]
            # `from pkg import sub` depends on the module sub; any other name comes from pkg itself
            targets = submodules + ([module] if len(submodules) < len(node.names) else [])
        else:
            continue
        targets += [sibling + t for t in targets if sibling and sibling + t in MODULES]
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: imports_of(name) for name in MODULES}


def entry(name: str) -> str:
    """The entry of ``LAYERS`` that holds module ``name``: the longest one that is ``name`` or a package above it."""
    holders = [e for _, entries in LAYERS for e in entries
               if name == e or (e != "rollcorr" and name.startswith(e + "."))]
    assert holders, f"{name}: on no floor of docs/architecture.md; add it to LAYERS and the page"
    return max(holders, key=len)


def layer(name: str) -> int:
    """The floor of module ``name`` (0 = leaf, the top)."""
    return next(i for i, (_, entries) in enumerate(LAYERS) if entry(name) in entries)


def edges() -> list[tuple[str, str]]:
    """Every import (importer, imported), the PENDING ones left out."""
    return [(a, b) for a, targets in sorted(GRAPH.items()) for b in sorted(targets) if (a, b) not in PENDING]


def test_every_import_goes_up_or_stays_on_its_floor():
    wrong = [f"{a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]})"
             for a, b in edges() if layer(b) > layer(a)]
    assert not wrong, "\n".join(wrong)


def test_the_tools_import_nothing_of_each_other():
    """audit, analyze, the drop-ins and the converter share only what lies above them (the dump format, the
    chunked pass, the MoE metrics, ...); one reading another would make two tools of one."""
    floor = [name for name, _ in LAYERS].index(SIDE_BY_SIDE)
    wrong = [f"{a} imports {b}" for a, b in edges()
             if layer(a) == layer(b) == floor and entry(a) != entry(b)]
    assert not wrong, "\n".join(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert cycles(GRAPH) == []


def test_no_two_parts_import_each_other():
    """The circle check on the entries of LAYERS: two apps (or packages) that import each other through
    different modules are one app in two folders, even when no two modules form a circle."""
    parts: dict[str, set[str]] = {entry(name): set() for name in MODULES}
    for a, b in edges():
        if entry(a) != entry(b):
            parts[entry(a)].add(entry(b))
    assert cycles(parts) == []


def test_pending_imports_are_still_there():
    gone = [f"{a} -> {b}" for a, b in sorted(PENDING) if b not in GRAPH.get(a, set())]
    assert not gone, f"no longer imported, remove from PENDING: {gone}"


def test_the_checker_sees_a_circle_and_a_wrong_way_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert layer("rollcorr.correction.api") < layer("rollcorr.train.loop")
    assert layer("rollcorr.dumps") < layer("rollcorr.analyze.analysis") == layer("rollcorr.audit.cli")
    assert entry("rollcorr.cli") == "rollcorr.cli" and entry("rollcorr") == "rollcorr"  # the root holds itself only
    assert "rollcorr.train.source" in GRAPH["rollcorr.train.executors"]  # function-level imports count too
    assert "rollcorr.train.ray_executor" in GRAPH["rollcorr.train.build"]
    assert "rollcorr.config.correction" in GRAPH["rollcorr.correction.rejection"]  # so do TYPE_CHECKING ones
    assert "experiments.common" in GRAPH["experiments.summary"] and layer("experiments.summary") == len(LAYERS) - 1
    assert "benchmarks.machine" in GRAPH["benchmarks.bench_correction"]  # a script's sibling, imported by its name


def test_the_page_names_every_floor():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    floors = re.findall(r"^\d+\. \*\*(\w+)\*\*", page, re.M)
    assert floors == [name for name, _ in LAYERS], floors


def layout_names() -> dict[str, set[str]]:
    """docs/architecture.md's "Layout (as built)" block: each folder of src/rollcorr ("" = the package itself) →
    the file names written in its entry (an entry runs from its `  folder/` line to the next entry)."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = page.split("## Layout (as built)", 1)[1].split("```", 2)[1]
    names: dict[str, set[str]] = {}
    folder = None
    for line in block.splitlines():
        if re.match(r"\S", line):  # src/rollcorr/ opens the package; tests/, benchmarks/ ... end it
            folder = "" if line.startswith("src/rollcorr/") else None
            continue
        entry = re.match(r"^  (\w+)(/|\.py)", line)
        if folder is not None and entry:
            folder = entry.group(1) if entry.group(2) == "/" else ""
        if folder is not None:
            names.setdefault(folder, set()).update(re.findall(r"\b(\w+\.py)\b", line))
    return names


def test_the_layout_names_every_module():
    """The map stays the house: a module added under src/rollcorr is named in the layout, in its folder's entry."""
    names = layout_names()
    missing = [path.relative_to(PACKAGE).as_posix() for path in sorted(PACKAGE.rglob("*.py"))
               if path.name != "__init__.py" and path.name not in names.get(path.parent.relative_to(PACKAGE).as_posix()
                                                                         .replace(".", ""), set())]
    assert not missing, "docs/architecture.md, Layout: name " + ", ".join(missing)


# ---------------------------------------------------------------- functions read top to bottom
LONGEST = 80  # lines a function may take, its signature and docstring included (docs/architecture.md)
# Functions over LONGEST known today, each with who shortens it; a test below fails once one is short enough, so
# the list stays true.
LONG_PENDING: dict[str, str] = {}


def function_lengths() -> dict[str, int]:
    """Every function and method of src/rollcorr by qualified name (module.Class.function) → its lines."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[name] = child.end_lineno - child.lineno + 1
                visit(child, name)

    for module, path in MODULES.items():
        if module.startswith("rollcorr"):
            visit(ast.parse(path.read_text(encoding="utf-8")), module)
    return out


def test_no_function_is_longer_than_80_lines():
    """A function longer than a screen is read in pieces; its steps become functions of their own, each with its
    name and docstring (the house rule: functions ≤ 80 lines)."""
    long = {name: n for name, n in function_lengths().items() if n > LONGEST and name not in LONG_PENDING}
    assert not long, "functions over 80 lines (split them into named steps): " + ", ".join(
        f"{name} ({n})" for name, n in sorted(long.items(), key=lambda kv: -kv[1])
    )


def test_long_pending_functions_are_still_long():
    lengths = function_lengths()
    done = [name for name in LONG_PENDING if lengths.get(name, 0) <= LONGEST]
    assert not done, f"no longer over {LONGEST} lines, remove from LONG_PENDING: {done}"


# ---------------------------------------------------------------- laid out by hand
# pyproject.toml turns `ruff format` off ([tool.ruff.format] exclude): the code is laid out by hand (continuation
# lines under their bracket, the terms of an equation under each other), which the formatter cannot be told to
# keep, and `ruff check` lints it all. A `# fmt: skip` marker then says nothing. The files below still hold
# some: each is being edited on a branch in flight today (removing a marker there would make its merge conflict);
# strip them once it lands. A test below fails once a listed file holds none, so the list stays true.
FMT_PENDING: dict[str, tuple[str, ...]] = {
}
FORMATTER_MARKER = re.compile(r"#\s*fmt:\s*(skip|off|on)\b")


def formatter_markers() -> dict[str, int]:
    """Every Python file of the repository (package, tests, studies) → how many formatter markers its comments
    hold (read as tokens: a marker inside a string does not count)."""
    out: dict[str, int] = {}
    for folder in ("src", "tests", "examples", *STUDIES):
        for path in sorted((ROOT / folder).rglob("*.py")):
            with path.open("rb") as f:
                count = sum(1 for t in tokenize.tokenize(f.readline)
                            if t.type == tokenize.COMMENT and FORMATTER_MARKER.match(t.string))
            if count:
                out[path.relative_to(ROOT).as_posix()] = count
    return out


def test_the_formatter_is_off_so_no_code_needs_fmt_skip():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["ruff"]
    assert config.get("force-exclude") is True and {"*.py", "*.md"} <= set(config["format"]["exclude"]), (
        "pyproject.toml: [tool.ruff.format] should exclude *.py and *.md (code laid out by hand)"
    )
    pending = {path for paths in FMT_PENDING.values() for path in paths}
    stray = {path: n for path, n in formatter_markers().items() if path not in pending}
    assert not stray, (
        "`# fmt:` markers (the formatter is off: they say nothing; `sed -i 's/  # fmt: skip$//' FILE`): "
        + ", ".join(f"{path} ({n})" for path, n in sorted(stray.items()))
    )


def test_fmt_pending_files_still_hold_markers():
    markers = formatter_markers()
    done = sorted(path for paths in FMT_PENDING.values() for path in paths if path not in markers)
    assert not done, f"no `# fmt:` markers left, remove from FMT_PENDING: {done}"


def test_the_marker_count_sees_comments_only():
    assert FORMATTER_MARKER.match("# fmt: skip") and FORMATTER_MARKER.match("#fmt: off")
    assert not FORMATTER_MARKER.match("# fmt: skipped") and not FORMATTER_MARKER.match("# format: skip")


def test_the_linter_passes():
    """`ruff check` (pyproject.toml's rules) holds over the whole repository: a lint error fails the suite, not only
    an editor. Skipped where ruff is not installed (it is in the `dev` extra the README's setup installs)."""
    pytest.importorskip("ruff")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--quiet", str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, f"ruff check found problems:\n{done.stdout[-3000:]}{done.stderr[-500:]}"
