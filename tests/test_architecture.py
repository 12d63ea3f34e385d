"""docs/architecture.md, checked: the layer rule holds for every import of every module under src/rollcorr
(also imports inside functions), and no modules import each other in a circle.

The imports are read with ``ast`` (nothing is imported); those under ``if TYPE_CHECKING:`` serve annotations
only and do not count. An import of a package is an edge to its
``__init__``; ``from package import name`` is an edge to ``package.name`` when that is a module, else to the
package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "rollcorr"

# docs/architecture.md, "Layers": a module imports only from its own floor or the floors above it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaf", ("rollcorr.rollout", "rollcorr.config.correction", "rollcorr.config.loss", "rollcorr.config.yaml_io",
              "rollcorr.safe_io")),
    ("math", ("rollcorr.correction", "rollcorr.losses", "rollcorr.advantages", "rollcorr.logprobs",
              "rollcorr.distributed.tensors")),
    ("config", ("rollcorr.config",)),
    ("engines", ("rollcorr.engines", "rollcorr.models", "rollcorr.tasks", "rollcorr.moe")),
    ("proximal", ("rollcorr.proximal",)),
    ("apps", ("rollcorr.compat", "rollcorr.analyze", "rollcorr.audit", "rollcorr.train", "rollcorr.distributed",
              "rollcorr.plotting", "rollcorr.cli", "rollcorr.data", "rollcorr")),
]  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """Every rollcorr module ``name`` imports, at any depth of its code."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # imports under `if TYPE_CHECKING:` count too: an annotation is a dependency
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
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: imports_of(name) for name in MODULES}


def layer(name: str) -> int:
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if name == prefix or name.startswith(prefix + ".")), default=None)  # fmt: skip
    assert best is not None, f"{name}: on no floor of docs/architecture.md; add it to LAYERS and the page"
    return best[1]


def test_every_import_goes_up_or_stays_on_its_floor():
    wrong = [f"{a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]})"
             for a, targets in sorted(GRAPH.items()) for b in sorted(targets) if layer(b) > layer(a)]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
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


def test_the_checker_sees_a_circle_and_a_wrong_way_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert layer("rollcorr.correction.api") < layer("rollcorr.train.loop")
    assert "rollcorr.train.source" in GRAPH["rollcorr.train.executors"]  # function-level imports count too
    assert "rollcorr.train.ray_executor" in GRAPH["rollcorr.train.build"]


def test_the_page_names_every_floor():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    floors = re.findall(r"^\d\. \*\*(\w+)\*\*", page, re.M)
    assert floors == [name for name, _ in LAYERS], floors
