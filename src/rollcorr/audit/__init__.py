"""``rollcorr audit``: measure how far the sampler's token probabilities are from the learner's.

collect (sample + score, or read a dump) → stats (pure functions on (B, T) log-probs) → plots (PNGs) →
report (summary.json, report.html, a rich table). The CLI is in ``rollcorr.audit.cli``. The names below load
on first use (PEP 562), so ``rollcorr audit --help`` imports no torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_HOMES = {"AuditData": "collect", "builtin_prompts": "collect", "collect": "collect", "from_log": "collect",
          "from_rollout": "collect", "load_prompts": "collect", "build_summary": "report",
          "print_summary": "report", "render_html": "report", "write_report": "report", "audit_stats": "stats"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'rollcorr.audit' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rollcorr.audit.{_HOMES[name]}"), name)


class _Package(types.ModuleType):
    """``collect`` names both a submodule and the function it exports. Loaded eagerly, the package bound the
    function after the submodule; loaded lazily, importing the submodule would bind the module for good. So the
    package's ``collect`` is always the function (the module stays ``sys.modules["rollcorr.audit.collect"]``)."""

    @property
    def collect(self) -> Any:
        return importlib.import_module("rollcorr.audit.collect").collect

    @collect.setter
    def collect(self, module: Any) -> None:  # the import system binding the submodule: ignored
        pass


sys.modules[__name__].__class__ = _Package
