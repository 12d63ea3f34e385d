"""Extensions from outside the package, imported by every process that needs them (docs/plugins.md).

A plugin is a module that registers what it holds — a loss, a rejection rule, a sampler engine, a π_old
strategy, a reward — through the same doors the built-ins use (``register_loss``, ``register_rule``,
``register_backend``, ``proximal.register``, ``register_reward``). Two ways in:

- **named**: ``plugins: [my_pkg.rollcorr_ext]`` in a training config (or ``plugins=[a,b]`` on its command
  line), ``--plugins a,b`` of ``rollcorr audit`` / ``analyze``: a module on the Python path or in the current
  folder;
- **installed**: a package whose metadata declares an entry point in the ``rollcorr.plugins`` group (as pytest
  plugins declare ``pytest11``) is loaded with no line at all; ``ROLLCORR_PLUGIN_AUTOLOAD=0`` starts without them.

``load_plugins`` is the one function that imports them: the config loader calls it in every process that
resolves a training config (the command, each rank of ``trainer.ranks=N`` or torchrun), and the sampler side
calls it where it is built (the async sampler process, each Ray worker). A plugin that cannot be imported or
fails while importing is one line naming it (``PluginError``), before any model loads.

Importing runs code, so only the user asks for it: a name inside a file rollcorr reads as data (a run folder's
``config.yaml``, a dump, a checkpoint) is never imported because the file says so; a caller that reads one
checks its names with ``not_loaded`` and asks the user to name them.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Iterable
from typing import Any

GROUP = "rollcorr.plugins"  # the entry-point group of installed plugins
AUTOLOAD_ENV = "ROLLCORR_PLUGIN_AUTOLOAD"  # "0": installed plugins are not loaded

_LOADED: dict[str, str] = {}  # module name → who asked for it ("plugins", "--plugins", "installed: dist x.y")
_INSTALLED: list[str] | PluginError | None = None  # the installed plugins' modules once loaded (or their error)


class PluginError(ValueError):
    """A plugin that cannot be imported, or failed while importing; one line naming it."""


def plugin_names(value: Any, key: str = "plugins") -> list[str]:
    """``value`` as a list of module names (a list, or one name), each a dotted Python name; ``PluginError``
    naming ``key`` otherwise (a path or a relative name is not a module)."""
    if value is None:
        return []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise PluginError(f"{key}: expected a list of module names, e.g. [my_pkg.rollcorr_ext], got {value!r:.80}")
    bad = [n for n in names if not n or not all(part.isidentifier() for part in n.split("."))]
    if bad:
        raise PluginError(f"{key}: {bad[0]!r:.80} is not a module name (dotted Python names, e.g. my_pkg.rollcorr_ext; "
                          "the module is found on the Python path or in the current folder)")
    return list(dict.fromkeys(names))  # in order, once each


def load_plugins(names: Iterable[str] = (), *, source: str = "plugins") -> list[str]:
    """Import the installed plugins (once per process), then each module of ``names`` (a module imports once).
    ``source`` names where the names came from, for the error line ("plugins", "--plugins"). Returns the
    modules ``names`` asked for. ``PluginError`` (one line naming the plugin) when one cannot be imported."""
    load_installed()
    names = plugin_names(list(names), source)
    if names and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())  # the current folder, as `python -m` has it, after everything installed
    for name in names:
        _import(name, f"{source}: {name!r}")
        _LOADED.setdefault(name, source)
    return names


def load_installed() -> list[str]:
    """Import every plugin installed with an entry point in the ``rollcorr.plugins`` group (once per process;
    none when ``ROLLCORR_PLUGIN_AUTOLOAD=0``). Returns their modules."""
    global _INSTALLED
    if isinstance(_INSTALLED, PluginError):
        raise _INSTALLED
    if _INSTALLED is not None:
        return _INSTALLED
    _INSTALLED = []
    if os.environ.get(AUTOLOAD_ENV, "1").strip() == "0":
        return _INSTALLED
    from importlib.metadata import entry_points

    modules = []
    for point in sorted(entry_points(group=GROUP), key=lambda p: p.name):
        dist = f"{point.dist.name} {point.dist.version}" if point.dist is not None else "an installed package"
        where = f"installed plugin {point.name} = {point.value!r} ({dist})"
        try:
            _import(point.module, where, f"; {AUTOLOAD_ENV}=0 starts without installed plugins")
        except PluginError as err:
            _INSTALLED = err
            raise
        _LOADED.setdefault(point.module, f"installed: {dist}")
        modules.append(point.module)
    _INSTALLED = modules
    return modules


def loaded() -> dict[str, str]:
    """The plugin modules this process imported, with who asked for each."""
    return dict(_LOADED)


def not_loaded(names: Iterable[str]) -> list[str]:
    """The modules of ``names`` this process has not imported (as plugins, named or installed, or by the user's
    own script): importing them now would run new code."""
    return [n for n in names if n not in sys.modules]


def _import(module: str, where: str, hint: str = "") -> None:
    """Import ``module``; ``PluginError`` "<where>: <what went wrong>" in one line."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and (module == err.name or module.startswith(err.name + ".")):
            raise PluginError(f"{where}: no module named {err.name!r} on the Python path or in the current "
                              f"folder{hint}") from None
        raise PluginError(f"{where}: failed while importing: {_said(err)}{hint}") from None
    except (Exception, SystemExit) as err:  # noqa: BLE001 — whatever the plugin raises is the plugin's failure
        raise PluginError(f"{where}: failed while importing: {_said(err)}{hint}") from None


def _said(err: BaseException) -> str:
    """``Type: first line (file.py:line)`` of an exception, at the innermost frame of code that raised it (a
    syntax error: where it is)."""
    if isinstance(err, SyntaxError) and err.filename:
        message, place = err.msg, (os.path.basename(err.filename), err.lineno)
    else:
        frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<frozen")]
        message = (str(err).strip().splitlines() or [""])[0]
        place = (os.path.basename(frames[-1].filename), frames[-1].lineno) if frames else None
    said = f"{type(err).__name__}: {message[:200]}" if message else type(err).__name__
    return f"{said} ({place[0]}:{place[1]})" if place else said
