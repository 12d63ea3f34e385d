"""The one YAML loader for user text (``train --config``, a run's ``config.yaml``, ``key=value`` overrides,
``analyze --config``): PyYAML's safe loader with bounds, so a hostile file cannot exhaust memory or hide a key.

- size: at most ``MAX_BYTES`` (1 MiB; a config is a few KiB);
- aliases: at most ``MAX_ALIASES`` ``*name`` references, and the document *as expanded* at most
  ``MAX_NODES`` nodes (a 900-byte "billion laughs" file expands to 10⁹ nodes: refused before it is built);
- depth: at most ``MAX_DEPTH`` nested collections;
- duplicate keys in one mapping are refused naming the key and line (PyYAML keeps the last one silently:
  ``trainer:`` twice dropped the first section).

Every refusal is a ``YamlError`` (a ``ValueError``) with one line; ``excerpt`` bounds any value quoted in
an error message.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1 << 20
MAX_ALIASES = 100
MAX_NODES = 100_000
MAX_DEPTH = 50


class YamlError(ValueError):
    """YAML text that is invalid or exceeds the loader's bounds; one line for the user."""


def excerpt(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (an error message never prints a whole file)."""
    if isinstance(value, dict | list) and len(value) > 20:  # repr of a huge shared structure is itself huge
        return f"<a {type(value).__name__} of {len(value)} entries>"
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text):,} chars)"


_INT = re.compile(r"""^(?:[-+]?0b[0-1]+
    |[-+]?0[0-7]+
    |[-+]?(?:0|[1-9][0-9]*)
    |[-+]?0x[0-9a-fA-F]+)$""", re.X)
_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+[eE][-+]?[0-9]+
    |[-+]?\.?(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


def _plain_numbers() -> dict:
    """SafeLoader's implicit resolvers with YAML 1.1's number forms that surprise people taken out — digits with
    underscores (``1.5_3`` would be 1.53: a verl "lo_hi" window read as a number) and base 60 (``1:30`` = 90) —
    and ``1e-4`` and ``inf`` read as the numbers they are (PyYAML needs a dot and a signed exponent, ``1.0e-4``,
    and reads ``inf`` as text; ``.inf`` still works)."""
    table = {}
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items():
        table[first] = [(tag, _INT if tag == "tag:yaml.org,2002:int" else _FLOAT if tag == "tag:yaml.org,2002:float"
                         else regexp) for tag, regexp in resolvers]
    for first in "iI":  # plain inf: the resolvers are looked up by a scalar's first character
        table.setdefault(first, []).insert(0, ("tag:yaml.org,2002:float", _FLOAT))
    return table


class _BoundedLoader(yaml.SafeLoader):
    yaml_implicit_resolvers = _plain_numbers()  # one meaning for 1.5_3 everywhere: a string, never 1.53

    def __init__(self, stream: str, source: str):
        super().__init__(stream)
        self.source, self.aliases, self.depth = source, 0, 0

    def _fail(self, what: str, mark) -> None:
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise YamlError(f"{self.source}: {what}{at}")

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                self._fail(f"more than {MAX_ALIASES} aliases (*name); refused", self.peek_event().start_mark)
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self._fail(f"nested deeper than {MAX_DEPTH} levels; refused", self.peek_event().start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _value in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: SafeConstructor names it
                    continue
                if first is not key_node.start_mark:
                    self._fail(f"key {excerpt(key, 60)} appears twice in one mapping (first at line "
                               f"{first.line + 1}); keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node, memo: dict[int, int]) -> int:
    """Nodes in ``node`` with every alias expanded (shared sub-graphs counted once per use)."""
    known = memo.get(id(node))
    if known is not None:
        return known
    memo[id(node)] = 1  # a recursive alias counts once (the safe constructor builds it as a cycle)
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    else:
        size = 1
    memo[id(node)] = min(size, MAX_NODES + 1)
    return memo[id(node)]


def load_yaml(text: str, source: str = "YAML") -> Any:
    """Parse ``text`` (one document) within the bounds above; ``YamlError`` naming ``source`` otherwise."""
    if len(text) > MAX_BYTES:
        raise YamlError(f"{source}: larger than {MAX_BYTES:,} characters; refused")
    loader = _BoundedLoader(text, source)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}) > MAX_NODES:
            raise YamlError(f"{source}: expands to more than {MAX_NODES:,} values through its aliases (a YAML "
                            "alias bomb?); refused")
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(err, "problem", None)
        raise YamlError(f"{source}: not valid YAML{at}{f' ({problem})' if problem else ''}") from None
    except RecursionError:
        raise YamlError(f"{source}: nested too deeply; refused") from None
    finally:
        loader.dispose()


def load_yaml_file(path: str | Path, source: str | None = None, *, inside_run: bool = False) -> Any:
    """``load_yaml`` of a file read as UTF-8 (at most ``MAX_BYTES``); ``inside_run``: a file of a run
    folder, which is not followed if it is a link (``rollcorr.safe_io``)."""
    from rollcorr.safe_io import UnsafePathError, read_bytes_inside

    source = source or f"config file {str(path)!r}"
    try:
        if inside_run:
            data = read_bytes_inside(path, limit=MAX_BYTES)
        else:
            with open(path, "rb") as f:
                data = f.read(MAX_BYTES + 1)
            if len(data) > MAX_BYTES:
                raise YamlError(f"{source}: larger than {MAX_BYTES:,} bytes; refused")
        text = data.decode("utf-8")
    except UnsafePathError as err:
        raise YamlError(str(err)) from None
    except UnicodeDecodeError as err:
        raise YamlError(f"{source}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise YamlError(f"{source}: cannot read ({(err.strerror or str(err)).lower()})") from None
    return load_yaml(text.removeprefix("\ufeff"), source)
