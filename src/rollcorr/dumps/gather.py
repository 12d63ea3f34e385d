"""Rows checked column by column (JSONL through orjson and ``array``, Parquet straight from Arrow's buffers), and
the exact per-row checks of the rows a column check flags (they give the reasons reported)."""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rollcorr.dumps.format import CORRECTION_FIELD, PER_TOKEN, ROUTED, _BadRow
from rollcorr.dumps.rows import _Rows, _segments

# Log-probs in (0, POSITIVE_TOL] are rounding noise of a probability ~1 and are clamped to 0; larger
# positive values are a broken row (a probability above 1).
POSITIVE_TOL = 1e-3


# ---- the vectorised checks ----------------------------------------------------------------------------------
_NUMBER, _INT, _STR = frozenset({float, int}), frozenset({int}), frozenset({str})


def _only(values: list, types: frozenset) -> bool:
    """Every entry's type is one of ``types`` (bool is not int here)."""
    return set(map(type, values)) <= types


_ARRAY_CODE = {"float": "d", "binary": "d", "int": "q"}


def _row_array(values: list, kind: str = "float") -> array.array | None:
    """One row's list as an ``array`` (float64; int64 for ``kind="int"``), or None when it holds anything else
    (None, strings, lists; integers past float range, or past int64 for "int"; floats for "int"). ``array``
    converts a list in one C loop; integers convert to float64 as ``float()`` does, and a bool reads as 1 / 0
    (``_bool_entries`` finds those)."""
    try:
        return array.array(_ARRAY_CODE[kind], values)
    except (TypeError, OverflowError):
        return None


def _joined(parts: list, dtype) -> np.ndarray:
    """Per-row ``array``s as one writable flat array (one copy)."""
    return np.frombuffer(bytearray().join(parts), dtype)


def _bool_entries(flat: np.ndarray, n: np.ndarray, lists: list, raws: list[bytes] | None,
                  suspect: np.ndarray) -> None:
    """Mark in ``suspect`` the rows whose number list (``lists[i]``, flattened into ``flat``) holds a JSON
    ``true`` / ``false``, which ``array`` read as 1.0 / 0.0: only entries equal to 0 or 1 can be one, so only
    those entries' types are looked at (a row with many such entries: its line is searched for ``true`` /
    ``false`` first, and its whole list checked only when the line has one)."""
    cand = np.flatnonzero((flat == 0) | (flat == 1))
    if not len(cand):
        return
    ends = np.cumsum(n)
    row_of = np.searchsorted(ends, cand, side="right")
    pos = cand - (ends - n)[row_of]
    rows, first, counts = np.unique(row_of, return_index=True, return_counts=True)
    for i, a, c in zip(rows.tolist(), first.tolist(), counts.tolist()):
        values = lists[i]
        if c > 16:
            if raws is not None and b"true" not in raws[i] and b"false" not in raws[i]:
                continue
            bad = not _only(values, _NUMBER)
        else:
            bad = any(type(values[p]) is bool for p in pos[a : a + c].tolist())
        if bad:
            suspect[i] = True


@dataclass
class _Gathered:
    """One block's candidate rows, column by column (``rows``, with every row's values in place; rows flagged
    so far in ``suspect``), before the value checks."""

    rows: _Rows
    suspect: np.ndarray  # (R,) bool
    adv_scalar: np.ndarray  # (R,) bool: the row's advantage is one number (broadcast)


def _gather_objects(objs: list[dict], lines: np.ndarray, raws: list[bytes] | None, names: dict[str, str | None],
                    extra_fields: Sequence[str]) -> _Gathered:
    """Decoded rows → columns. Structure is checked here row by row (types, list lengths); numbers column by
    column, each row's list converted in one C call (``_row_array``) and joined. Booleans are found from the
    converted values (``_bool_entries``); a row with ``true`` / ``false`` in its line (or any row without a raw
    line, e.g. Parquet's Python rows) has its optional per-token lists' entry types checked too."""
    rn, ln, mn = names["rollout"], names["learner"], names["mask"]
    an, tn, vn, un = names["advantages"], names["tokens"], names["version"], names["turn"]
    ttn, xn = names["token_text"], names["text"]
    routed_names = [(role, names[role]) for role in ROUTED if names[role] is not None]
    size = len(objs)
    n = np.zeros(size, np.int64)
    suspect = np.zeros(size, bool)
    adv_scalar = np.zeros(size, bool)
    parts_r: list = []
    parts_l: list = []
    lists_r: list = [None] * size
    lists_l: list = [None] * size
    mask_rows: list = [None] * size
    numeric_rows: dict[str, list] = {role: [None] * size for role in PER_TOKEN}
    token_text: list = [None] * size
    text: list = [None] * size
    routed: dict[str, list] = {role: [None] * size for role in ROUTED}
    extras: dict[str, list] = {key: [None] * size for key in extra_fields}
    correction: list = [None] * size
    optional = [(role, name, kinds) for role, name, kinds in
                (("advantages", an, _NUMBER), ("tokens", tn, _INT), ("version", vn, _INT), ("turn", un, _INT))
                if name is not None]
    for i, obj in enumerate(objs):
        r, lp = obj.get(rn), obj.get(ln)
        if type(r) is not list or type(lp) is not list or len(r) != len(lp) or not r:
            suspect[i] = True
            continue
        k = len(r)
        m = obj.get(mn) if mn is not None else None
        if m is not None and (type(m) is not list or len(m) != k):
            suspect[i] = True
            continue
        ar, al = _row_array(r), _row_array(lp)
        if ar is None or al is None:
            suspect[i] = True
            continue
        try:
            values, adv_scalar[i], token_text[i], routes = _optional_of(obj, k, optional, ttn, routed_names,
                                                                         None if raws is None else raws[i])
        except (_BadRow, OverflowError):
            suspect[i] = True
            continue
        for role, value in values.items():
            numeric_rows[role][i] = value
        for role, value in routes.items():
            routed[role][i] = value
        n[i] = k
        parts_r.append(ar)
        parts_l.append(al)
        lists_r[i], lists_l[i] = r, lp
        if m is not None and m.count(1) != k:  # all ones (1, 1.0, true): every position valid, as without a mask
            mask_rows[i] = m
        if xn is not None and type(x := obj.get(xn)) is str:
            text[i] = x
        for key in extra_fields:
            extras[key][i] = obj.get(key)
        if type(c := obj.get(CORRECTION_FIELD)) is dict:
            correction[i] = c
    starts = np.cumsum(n) - n
    total = int(n.sum())
    rollout = _joined(parts_r, np.float64)
    learner = _joined(parts_l, np.float64)
    _bool_entries(rollout, n, lists_r, raws, suspect)
    _bool_entries(learner, n, lists_l, raws, suspect)
    mask = _aligned(mask_rows, starts, n, suspect, total, "binary", fill=1.0)
    numeric = {}
    has = {}
    for role, values in numeric_rows.items():
        has[role] = np.array([v is not None for v in values], bool) & ~suspect
        if has[role].any():
            numeric[role] = _aligned(values, starts, n, suspect, total, "float" if role == "advantages" else "int")
    rows = _Rows(lines=lines, n=n, rollout=rollout, learner=learner, mask=mask != 0, numeric=numeric, has=has,
                 token_text=token_text, text=text, routed=routed, extras=extras, correction=correction)
    return _Gathered(rows, suspect, adv_scalar)


def _optional_of(obj: dict, k: int, optional: list, ttn: str | None, routed_names: list, raw: bytes | None
                 ) -> tuple[dict[str, list], bool, list | None, dict[str, list]]:
    """Row ``obj``'s optional fields, each of ``k`` entries: (the per-token numbers by role, whether its advantage
    is one number, its token texts or None, its routed experts by role). ``_BadRow`` (or ``OverflowError``: a
    number past float range) when one does not fit. A row whose line holds ``true`` / ``false`` (or has no line,
    ``raw`` None) has its lists' entry types checked too."""
    values: dict[str, list] = {}
    scalar, strict = False, None  # strict: computed when an optional list needs it
    for role, name, kinds in optional:
        value = obj.get(name)
        if value is None:
            continue
        if role == "advantages" and type(value) in (float, int):
            values[role] = [float(value)] * k  # OverflowError: past float range
            scalar = True
        elif type(value) is list and len(value) == k:
            if strict is None:
                strict = raw is None or b"true" in raw or b"false" in raw
            if strict and not _only(value, kinds):
                raise _BadRow
            values[role] = value
        else:
            raise _BadRow
    tt = None
    if ttn is not None and (tt := obj.get(ttn)) is not None:
        if type(tt) is not list or len(tt) != k or not _only(tt, _STR):
            raise _BadRow
    routes = {role: _routing_rows(obj, name, k) for role, name in routed_names if obj.get(name) is not None}
    return values, scalar, tt, routes


def _aligned(per_row: list, starts: np.ndarray, n: np.ndarray, suspect: np.ndarray, total: int, kind: str,
             fill: float = 0) -> np.ndarray:
    """Per-row lists (None: absent → ``fill``) as one flat array aligned with the rows' segments; rows whose list
    is not numbers (integers for ``kind="int"``; all 0/1 for ``"binary"``) are marked in ``suspect``."""
    dtype = np.int64 if kind == "int" else np.float64
    out = np.full(total, fill, dtype=dtype)
    parts, present = [], []
    for i, v in enumerate(per_row):
        if v is None or suspect[i]:
            continue
        a = _row_array(v, kind)
        if a is None:
            suspect[i] = True
        else:
            parts.append(a)
            present.append(i)
    if not present:
        return out
    sel = np.array(present, np.int64)
    values = _joined(parts, dtype)
    if kind == "binary":
        bad = ~((values == 0) | (values == 1))
        if bad.any():
            suspect[np.unique(np.repeat(sel, n[sel])[bad])] = True
    out[_segments(starts[sel], n[sel])] = values
    return out


def _arrow_nulls(arr) -> np.ndarray:
    """(len(arr),) bool: where an Arrow array (primitive or list) is null, from its validity bitmap (numpy alone:
    ``pyarrow.compute`` costs a quarter of a second to import)."""
    if arr.null_count == 0:
        return np.zeros(len(arr), bool)
    bits = np.frombuffer(arr.buffers()[0], np.uint8)
    return np.unpackbits(bits, count=arr.offset + len(arr), bitorder="little")[arr.offset :] == 0


def _arrow_numbers(arr, dtype) -> np.ndarray:
    """A primitive Arrow array of integers, floats or bools as a new numpy array of ``dtype`` (integers convert
    as a cast does; entries at nulls are arbitrary), read from its data buffer (``Array.to_numpy`` would import
    pandas)."""
    import pyarrow as pa

    end = arr.offset + len(arr)
    if len(arr) == 0:
        return np.zeros(0, dtype)
    if pa.types.is_boolean(arr.type):
        values = np.unpackbits(np.frombuffer(arr.buffers()[1], np.uint8), count=end, bitorder="little")
    else:
        t = arr.type
        kind = "f" if pa.types.is_floating(t) else "i" if pa.types.is_signed_integer(t) else "u"
        values = np.frombuffer(arr.buffers()[1], np.dtype(f"{kind}{t.bit_width // 8}"), count=end)
    return values[arr.offset :].astype(dtype)


class _ArrowBatch:
    """One Parquet record batch read straight from Arrow's buffers (``Array.to_numpy`` would import pandas):
    columns by name, list offsets, list values, and per-token columns placed on the rows' flat layout.
    ``suspect`` (R,) marks the rows a column check flags (they go through the exact per-row checks)."""

    def __init__(self, batch) -> None:
        import pyarrow as pa

        self.pa, self.batch, self.size = pa, batch, batch.num_rows

    def column(self, name):
        schema = self.batch.schema
        return self.batch.column(schema.get_field_index(name)) if name is not None and name in schema.names else None

    def is_list(self, col) -> bool:
        """A list column of numbers or bools (those may be a mask)."""
        pa, t = self.pa, col.type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
            return False
        v = t.value_type
        return pa.types.is_integer(v) or pa.types.is_floating(v) or pa.types.is_boolean(v)

    def offsets(self, col) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the list offsets, each row's length, the null rows), from the offsets buffer."""
        width = np.int64 if self.pa.types.is_large_list(col.type) else np.int32
        off = np.frombuffer(col.buffers()[1], width, count=col.offset + len(col) + 1)[col.offset :].astype(np.int64)
        return off, np.diff(off), _arrow_nulls(col)

    @staticmethod
    def values(col, off, dtype) -> tuple[np.ndarray, np.ndarray | None]:
        """(the list entries as ``dtype``: NaN at null entries for float64, anything for int64; where the nulls
        are, or None)"""
        v = col.values.slice(int(off[0]), int(off[-1] - off[0]))
        nulls = _arrow_nulls(v) if v.null_count else None
        out = _arrow_numbers(v, dtype)
        if nulls is not None and dtype == np.float64:
            out[nulls] = np.nan
        return out, nulls

    def layout(self, r_col, l_col) -> None:
        """The rows' lengths from the two log-prob columns (``n``, 0 for a suspect row), their starts in the flat
        layout and its size; ``suspect`` starts with the rows those columns flag."""
        self.r_off, n, r_null = self.offsets(r_col)
        self.l_off, l_n, l_null = self.offsets(l_col)
        self.suspect = r_null | l_null | (n == 0) | (l_n != n)
        self.n = np.where(self.suspect, 0, n)
        self.starts = np.cumsum(self.n) - self.n
        self.total = int(self.n.sum())

    def place(self, col, dtype, fill=0, kind="numbers"):
        """(aligned flat values, has (R,)) of a per-token column, marking rows with a list of another length
        (or, for integers and masks, a null entry) in ``suspect``."""
        n, suspect = self.n, self.suspect
        off, ln, null = self.offsets(col)
        has = ~null & ~suspect
        wrong = has & (ln != n)
        suspect[wrong] = True
        has &= ~wrong
        vals, nulls = self.values(col, off, dtype)
        out = np.full(self.total, fill, dtype=dtype)
        sel = np.flatnonzero(has)
        src = _segments(off[sel] - off[0], n[sel])
        if nulls is not None and kind != "numbers":
            null_rows = np.unique(np.repeat(sel, n[sel])[nulls[src]])
            suspect[null_rows] = True
        if kind == "binary":
            bad = ~((vals[src] == 0) | (vals[src] == 1))
            if bad.any():
                suspect[np.unique(np.repeat(sel, n[sel])[bad])] = True
        out[_segments(self.starts[sel], n[sel])] = vals[src]
        return out, has

    def numeric(self, names: dict[str, str | None]) -> tuple[dict, dict, np.ndarray] | None:
        """The optional per-token numbers (advantages, token ids, versions, turns): (values, has, rows whose
        advantage is one number); None when a column is of a kind this does not read."""
        pa, size = self.pa, self.size
        numeric, has = {}, {}
        adv_scalar = np.zeros(size, bool)
        for role, dtype in (("advantages", np.float64), ("tokens", np.int64), ("version", np.int64), ("turn", np.int64)):
            col = self.column(names[role])
            has[role] = np.zeros(size, bool)
            if col is None:
                continue
            if role == "advantages" and (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
                has[role] = ~_arrow_nulls(col) & ~self.suspect
                per_row = _arrow_numbers(col, np.float64)
                numeric[role] = np.repeat(np.where(has[role], per_row, 0.0), self.n)
                adv_scalar = has[role].copy()
                continue
            if not self.is_list(col) or pa.types.is_boolean(col.type.value_type):
                return None  # e.g. a string column, bools: the Python rows say what is wrong
            if role != "advantages" and not pa.types.is_signed_integer(col.type.value_type):
                return None  # floats or uint64 ids: not "integers within int64" row by row
            numeric[role], has[role] = self.place(col, dtype, kind="numbers" if role == "advantages" else "ints")
            if not has[role].any():
                del numeric[role]
        return numeric, has, adv_scalar

    def python_columns(self, names: dict[str, str | None], extra_fields: Sequence[str]) -> dict[str, Any]:
        """The columns read as Python values: token texts (checked against the row lengths), response texts,
        routed experts, the extra fields and the recorded correction."""
        size, suspect, n = self.size, self.suspect, self.n
        token_text: list = [None] * size
        col = self.column(names["token_text"])
        if col is not None:
            for i, tt in enumerate(col.to_pylist()):
                if tt is None or suspect[i]:
                    continue
                if type(tt) is not list or len(tt) != n[i] or not _only(tt, _STR):
                    suspect[i] = True
                else:
                    token_text[i] = tt
        col = self.column(names["text"])
        text = [x if type(x) is str else None for x in col.to_pylist()] if col is not None else [None] * size
        routed: dict[str, list] = {role: [None] * size for role in ROUTED}
        for role in ROUTED:
            col = self.column(names[role])
            if col is None:
                continue
            for i, value in enumerate(col.to_pylist()):
                if value is None or suspect[i]:
                    continue
                try:
                    routed[role][i] = _routing_rows({names[role]: value}, names[role], int(n[i]))
                except _BadRow:
                    suspect[i] = True
        column = self.column
        extras = {key: (column(key).to_pylist() if column(key) is not None else [None] * size) for key in extra_fields}
        col = column(CORRECTION_FIELD)
        correction = [c if type(c) is dict else None for c in col.to_pylist()] if col is not None else [None] * size
        return {"token_text": token_text, "text": text, "routed": routed, "extras": extras, "correction": correction}


def _gather_arrow(batch, lines: np.ndarray, names: dict[str, str | None], extra_fields: Sequence[str]) -> _Gathered | None:
    """A Parquet record batch → columns, straight from Arrow's buffers; None when a column is of a kind this
    does not read (then the batch goes through its Python rows)."""
    arrow = _ArrowBatch(batch)
    pa = arrow.pa
    r_col, l_col = arrow.column(names["rollout"]), arrow.column(names["learner"])
    if r_col is None or l_col is None or not arrow.is_list(r_col) or not arrow.is_list(l_col):
        return None
    if pa.types.is_boolean(r_col.type.value_type) or pa.types.is_boolean(l_col.type.value_type):
        return None
    arrow.layout(r_col, l_col)
    n, ok = arrow.n, np.flatnonzero(~arrow.suspect)
    r_vals, _ = arrow.values(r_col, arrow.r_off, np.float64)
    l_vals, _ = arrow.values(l_col, arrow.l_off, np.float64)
    rollout = r_vals[_segments(arrow.r_off[ok] - arrow.r_off[0], n[ok])]
    learner = l_vals[_segments(arrow.l_off[ok] - arrow.l_off[0], n[ok])]
    mask = np.ones(arrow.total, np.float64)
    m_col = arrow.column(names["mask"])
    if m_col is not None:
        if not arrow.is_list(m_col):
            return None
        mask, _ = arrow.place(m_col, np.float64, fill=1.0, kind="binary")
    per_token = arrow.numeric(names)
    if per_token is None:
        return None
    numeric, has, adv_scalar = per_token
    python = arrow.python_columns(names, extra_fields)
    for role in has:
        has[role] &= ~arrow.suspect
    rows = _Rows(lines=lines, n=n, rollout=rollout, learner=learner, mask=mask != 0, numeric=numeric, has=has,
                 **python)
    return _Gathered(rows, arrow.suspect, adv_scalar)


def _value_checks(g: _Gathered) -> np.ndarray:
    """The checks on the numbers, vectorised over the block: on valid tokens both log-probs finite and
    ≤ ``POSITIVE_TOL``, advantages finite; at least one valid token. Flags failing rows in ``g.suspect``
    (returned) and, on the rest, zeroes mask-0 positions and clamps rounding noise (0, tol] to 0 in place."""
    rows, suspect = g.rows, g.suspect
    live = np.flatnonzero((rows.n > 0) & ~suspect)
    if not len(live):
        return suspect | (rows.n == 0)
    starts = rows.starts
    valid = rows.mask
    bad = np.zeros(len(valid), bool)
    for x in (rows.rollout, rows.learner):
        bad |= valid & ~((x <= POSITIVE_TOL) & np.isfinite(x))
    if "advantages" in rows.numeric:
        bad |= valid & ~np.isfinite(rows.numeric["advantages"])
    flagged = np.zeros(len(rows), bool)
    nonempty = np.flatnonzero(rows.n > 0)  # segments delimit each other: every non-empty row takes part
    at = starts[nonempty]
    flagged[nonempty] = np.logical_or.reduceat(bad, at) | ~np.logical_or.reduceat(valid, at)
    suspect = suspect | flagged | (rows.n == 0)
    for x in (rows.rollout, rows.learner):
        np.copyto(x, 0.0, where=~(valid & (x <= 0)))
    if "advantages" in rows.numeric:
        np.copyto(rows.numeric["advantages"], 0.0, where=~valid)
    for role in rows.has:
        rows.has[role] &= ~suspect
    return suspect


def _rows_of_parsed(row: dict[str, Any], line: int, extra_fields: Sequence[str]) -> _Rows:
    """One row from ``_parse_row`` as a one-row ``_Rows``."""
    numeric = {}
    has = {}
    for role, dtype in (("advantages", np.float64), ("tokens", np.int64), ("version", np.int64), ("turn", np.int64)):
        has[role] = np.array([role in row])
        if role in row:
            numeric[role] = np.array(row[role], dtype=dtype)
    return _Rows(
        lines=np.array([line], np.int64), n=np.array([len(row["rollout"])], np.int64),
        rollout=np.array(row["rollout"], np.float64), learner=np.array(row["learner"], np.float64),
        mask=np.array(row["mask"], bool), numeric=numeric, has=has, token_text=[row.get("token_text")],
        text=[row.get("text")], routed={role: [row.get(role)] for role in ROUTED},
        extras={key: [row["extras"][key]] for key in extra_fields}, correction=[row.get("correction")],
    )


# ---- the exact per-row checks (flagged rows; they give the reasons reported) ----------------------------------
def _number_list(obj: dict[str, Any], name: str) -> list[float]:
    """The field as floats (JSON null → NaN); a non-list or a non-number entry is a bad row."""
    value = obj[name]
    if not isinstance(value, list | tuple) or any(
        not (x is None or isinstance(x, int | float)) or isinstance(x, bool) for x in value
    ):
        raise _BadRow(f"field {name!r} is not a list of numbers")
    try:
        return [math.nan if x is None else float(x) for x in value]
    except OverflowError:
        t = next(t for t, x in enumerate(value) if isinstance(x, int) and abs(x) > 1e308)
        raise _BadRow(f"field {name!r} has a number too large for a float at token {t}") from None


def _typed_list(obj: dict[str, Any], name: str, kind: type, what: str) -> list[Any]:
    value = obj[name]
    if not isinstance(value, list | tuple) or any(
        not isinstance(x, kind) or isinstance(x, bool) for x in value
    ):
        raise _BadRow(f"field {name!r} is not a list of {what}")
    if kind is int:
        for t, x in enumerate(value):
            if not -(2**63) <= x < 2**63:
                raise _BadRow(f"field {name!r} has an integer outside the int64 range at token {t}")
    return list(value)


def _parse_row(
    obj: dict[str, Any], names: dict[str, str | None], extra_fields: Sequence[str]
) -> dict[str, Any]:
    """Validate one row; return its per-token lists (full length, 0 at mask-0 positions) and extras."""
    rollout_name, learner_name, mask_name = names["rollout"], names["learner"], names["mask"]
    for name in (rollout_name, learner_name):
        if name not in obj:
            raise _BadRow(f"missing field {name!r}")
    rollout = _number_list(obj, rollout_name)
    n = len(rollout)

    def same_length(name: str, values: list[Any]) -> list[Any]:
        if len(values) != n:
            raise _BadRow(f"ragged: {rollout_name!r} has {n} tokens but {name!r} has {len(values)}")
        return values

    learner = same_length(learner_name, _number_list(obj, learner_name))
    mask = [True] * n
    if mask_name is not None and obj.get(mask_name) is not None:  # the mask is optional, row by row
        raw = obj[mask_name]
        if not isinstance(raw, list | tuple) or any(x not in (0, 1) for x in raw):
            raise _BadRow(f"field {mask_name!r} must be a list of 0/1 values")
        mask = [bool(x) for x in same_length(mask_name, list(raw))]
    if not any(mask):
        raise _BadRow("empty response (no valid tokens)")

    for name, values in ((rollout_name, rollout), (learner_name, learner)):
        for t, (x, valid) in enumerate(zip(values, mask)):
            if valid and not math.isfinite(x):
                raise _BadRow(f"non-finite {name!r} at token {t} ({x})")
            if valid and x > POSITIVE_TOL:
                raise _BadRow(f"positive log-prob in {name!r} at token {t} ({x:.4g})")
        # padding may hold anything; tiny positives on valid tokens are rounding noise of p ≈ 1
        values[:] = [x if valid and x <= 0 else 0.0 for x, valid in zip(values, mask)]
    row: dict[str, Any] = {"rollout": rollout, "learner": learner, "mask": mask}

    present = {role: names[role] for role in ("advantages", "tokens", "version", "turn", "token_text", "text")}
    present = {role: name for role, name in present.items() if name is not None and obj.get(name) is not None}
    if "advantages" in present:  # per token, or one number per row
        name = present["advantages"]
        adv = obj[name]
        try:
            adv = (
                [float(adv)] * n
                if isinstance(adv, int | float) and not isinstance(adv, bool)
                else _number_list(obj, name)
            )
        except OverflowError:  # an integer past float range (JSON allows 10⁴⁰⁰)
            raise _BadRow(f"field {name!r} holds a number too large for a float") from None
        if any(not math.isfinite(a) for a, valid in zip(same_length(name, adv), mask) if valid):
            raise _BadRow(f"non-finite {name!r} on a valid token")
        row["advantages"] = [a if valid else 0.0 for a, valid in zip(adv, mask)]
    for role in ("tokens", "version", "turn"):
        if role in present:
            row[role] = same_length(present[role], _typed_list(obj, present[role], int, "integers"))
    if "token_text" in present:
        row["token_text"] = same_length(
            present["token_text"], _typed_list(obj, present["token_text"], str, "strings")
        )
    for role in ("routed_experts", "learner_routed_experts"):
        if names.get(role) is not None and obj.get(names[role]) is not None:
            row[role] = _routing_rows(obj, names[role], n)
    if "text" in present and isinstance(obj[present["text"]], str):
        row["text"] = obj[present["text"]]
    row["extras"] = {key: obj.get(key) for key in extra_fields}
    if isinstance(obj.get(CORRECTION_FIELD), dict):
        row["correction"] = obj[CORRECTION_FIELD]
    return row


def _routing_rows(obj: dict[str, Any], name: str, n: int) -> list:
    """A row's routed experts as n entries of (L, k) integer lists, one per response token.

    n entries are taken as they are (rollcorr's layout: entry t is the routing of the position that predicts
    token t). A longer list is a whole sequence, prompt + response, one entry per input position (as verl and
    SkyRL batch them): its entries m − n − 1 … m − 2 are the positions predicting the n response tokens.
    """
    value = obj[name]
    try:
        raw = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise _BadRow(f"field {name!r} is not a (tokens, layers, top_k) array of integers") from None
    if raw.dtype == torch.bool:  # JSON true/false are not expert ids (they would read as 0 and 1)
        raise _BadRow(f"field {name!r} holds booleans, not expert ids (integers)")
    if raw.is_floating_point():
        if not torch.isfinite(raw).all() or (raw != raw.round()).any():  # 1.9 would be truncated to expert 1
            bad = raw[~torch.isfinite(raw) | (raw != raw.round())][0].item()
            raise _BadRow(f"field {name!r} holds a non-integer expert id ({bad:g}); expert ids are integers")
    routes = raw.long()
    if routes.dim() != 3 or routes.shape[0] < n or (routes < 0).any():
        raise _BadRow(f"field {name!r} must be (tokens, layers, top_k) non-negative integers with ≥ {n} tokens, "
                      f"got shape {tuple(routes.shape)}")
    if routes.shape[0] > n:
        routes = routes[routes.shape[0] - n - 1 : routes.shape[0] - 1]
    return routes.tolist()


def _routing_note(having: dict[str, int], shapes: dict[str, list], rows: int) -> str | None:
    """Why the sampler's and the learner's routing cannot be compared over the whole dump, in words; None when
    they can (both on every row, one (layers, top_k) shape each, the same one)."""
    words = {"routed_experts": "the sampler's routed experts", "learner_routed_experts": "the learner's"}
    parts = []
    for role in ROUTED:
        if having[role] < rows:
            parts.append(f"{words[role]} are on {having[role]} of {rows} rows")
        elif len(shapes[role]) > 1:
            parts.append(f"{words[role]} have several (layers, top-k) shapes: {', '.join(map(str, shapes[role]))}")
    if not parts and shapes["routed_experts"] != shapes["learner_routed_experts"]:
        parts.append(f"the sampler's routing has (layers, top-k) {shapes['routed_experts'][0]} and the learner's "
                     f"{shapes['learner_routed_experts'][0]}")
    return ("routing not compared: " + "; ".join(parts)) if parts else None


