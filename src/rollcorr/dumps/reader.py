"""The reader: ``open_dump`` → ``DumpReader`` (block by block, chunks of bounded size) and ``read_dump`` (the whole
dump; the same arguments: one reader signature). The field names are resolved here, from the first blocks."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rollcorr.dumps.format import (
    CORRECTION_FIELD,
    DEFAULT_FIELDS,
    FIELD_ALIASES,
    PER_TOKEN,
    ROUTED,
    Dump,
    DumpInfo,
    MalformedRow,
    _BadRow,
)
from rollcorr.dumps.gather import (
    _gather_arrow,
    _gather_objects,
    _Gathered,
    _parse_row,
    _routing_note,
    _rows_of_parsed,
    _value_checks,
)
from rollcorr.dumps.rows import _as_dump, _concat_rows, _Rows, _take_rows
from rollcorr.dumps.streams import _decode, _decode_exact, _jsonl_blocks, _open_source

CHUNK_POSITIONS = 1 << 17  # padded positions (rows × longest row) of one chunk
POOL_TOKENS = 1 << 19  # valid rows gathered (in tokens) before they are grouped by length into chunks
PARQUET_BATCH_ROWS = 512  # rows per Parquet record batch
FIRST_BLOCKS = 16  # JSONL blocks read, at most, to find the log-prob fields before saying they are absent


# ---- the reader ---------------------------------------------------------------------------------------------
def open_dump(
    path: str | Path,
    *,
    rollout_field: str = DEFAULT_FIELDS["rollout"],
    learner_field: str = DEFAULT_FIELDS["learner"],
    mask_field: str = DEFAULT_FIELDS["mask"],
    advantages_field: str = DEFAULT_FIELDS["advantages"],
    tokens_field: str = DEFAULT_FIELDS["tokens"],
    token_text_field: str = DEFAULT_FIELDS["token_text"],
    text_field: str = DEFAULT_FIELDS["text"],
    version_field: str = DEFAULT_FIELDS["version"],
    routed_experts_field: str = DEFAULT_FIELDS["routed_experts"],
    extra_fields: Sequence[str] = ("prompt", "reward"),
    fields: dict[str, str] | None = None,
) -> DumpReader:
    """Open a dump for reading block by block (``DumpReader``); ``path`` may be ``-`` (standard input), a FIFO
    (``<(cat f)``) or ``/dev/stdin``. The field names are resolved here, so a dump without the log-prob fields
    fails before any row is analysed. The one reader signature: ``read_dump`` takes the same arguments.

    ``<role>_field``: the field read for each role; ``fields`` maps roles (the keys below) to names and overrides
    them. Raises ``FileNotFoundError`` for a missing file and ``ValueError`` when a required field is in no row
    of the first blocks."""
    wanted = {
        "rollout": rollout_field,
        "learner": learner_field,
        "mask": mask_field,
        "advantages": advantages_field,
        "tokens": tokens_field,
        "token_text": token_text_field,
        "text": text_field,
        "version": version_field,
        "routed_experts": routed_experts_field,
        "learner_routed_experts": DEFAULT_FIELDS["learner_routed_experts"],
        "turn": DEFAULT_FIELDS["turn"],
    }
    unknown = set(fields or {}) - set(wanted)
    if unknown:
        raise ValueError(f"unknown field role(s) {sorted(unknown)}; roles are {sorted(wanted)}")
    return DumpReader(path, {**wanted, **(fields or {})}, extra_fields)


def read_dump(path: str | Path, **options: Any) -> Dump:
    """Read a JSONL (``.jsonl``, ``.jsonl.gz``, anything else) or Parquet (``.parquet``/``.pq``) rollout dump
    whole, right-padded to its longest row (``open_dump`` reads it chunk by chunk instead; its arguments, the
    one reader signature, are these). Raises ``FileNotFoundError`` for a missing file and ``ValueError`` when
    no row is usable or a required field is in no row."""
    reader = open_dump(path, **options)
    rows = _concat_rows(list(reader.blocks()), reader.extra_fields)
    info = reader.info()
    order = np.argsort(rows.lines, kind="stable")
    dump = _as_dump(rows, order, reader.path, info.fields, reader.extra_fields)
    b = len(dump)
    dump.malformed = info.malformed
    dump.total_rows = info.total_rows
    dump.correction, dump.corrections_seen = info.correction, info.corrections_seen
    dump.partial = {role: lines for role, lines in info.partial.items() if lines and len(lines) < b}
    return dump


class DumpReader:
    """A rollout dump read block by block (``open_dump``). ``chunks()`` (or ``blocks()``) can be iterated once;
    the counters (``malformed``, ``total_rows``, ``rows``, ``num_tokens``) grow as it goes, and ``info()`` sums
    them up once every block was read. ``fields``: role → the field name read (resolved on opening)."""

    def __init__(self, path: str | Path, wanted: dict[str, str], extra_fields: Sequence[str]) -> None:
        self.extra_fields = tuple(extra_fields)
        self.path, self._kind, self._stream, self._gz = _open_source(path)
        self.malformed: list[MalformedRow] = []
        self.total_rows = self.rows = self.num_tokens = 0
        self._having = {role: 0 for role in (*PER_TOKEN, "token_text", "text", *ROUTED)}
        self._lacking: dict[str, list[int]] = {role: [] for role in PER_TOKEN}
        self._route_shapes: dict[str, set] = {role: set() for role in ROUTED}
        self._corrections: dict[str, dict[str, Any]] = {}
        self._used = False
        if self._kind == "parquet":
            keys, self._source = self._parquet_source(wanted)
            self._first: list = []
        else:
            keys, self._first, self._source = self._jsonl_source(wanted)
        self._wanted, self._keys = wanted, keys
        self.names = {role: _resolve(role, name, keys) for role, name in wanted.items()}
        # an optional field first seen further on is read from there on (the rows before lack it)
        self._unresolved = {role for role, name in self.names.items() if name is None}
        for role in self._unresolved if self._kind == "parquet" else ():  # the schema names every column
            if wanted[role] != DEFAULT_FIELDS[role] and role not in ("rollout", "learner"):
                raise ValueError(f"{self.path}: no row has the {role} field {wanted[role]!r}; fields present: "
                                 f"{sorted(keys)}")
        for role in ("rollout", "learner"):
            if self.names[role] is None:
                also = ""
                if wanted[role] == DEFAULT_FIELDS[role]:
                    also = f" (nor {', '.join(FIELD_ALIASES[role][1:])})"
                raise ValueError(
                    f"{self.path}: no row has the {role} log-prob field {wanted[role]!r}{also}; fields present: "
                    f"{sorted(keys)}. Name it with --{role}-field / {role}_field=."
                )
        self.fields = {role: name for role, name in self.names.items() if name is not None}

    # -- sources ------------------------------------------------------------------------------------------
    def _jsonl_source(self, wanted: dict[str, str]) -> tuple[set[str], list, Iterator]:
        """(keys of the blocks read so far, those decoded blocks, the rest): blocks are read until one holds an
        object with both log-prob fields (``FIRST_BLOCKS`` at most)."""
        blocks = _jsonl_blocks(self._stream, self._gz, self.path)
        first: list = []
        keys: set[str] = set()
        for records in blocks:
            decoded = [(line, raw if isinstance(raw, _BadRow) else _decode(raw), raw) for line, raw in records]
            first.append(decoded)
            for _, obj, _ in decoded:
                if isinstance(obj, dict):
                    keys.update(obj)
            found = all(_resolve(role, wanted[role], keys) for role in ("rollout", "learner"))
            if (keys and found) or len(first) >= FIRST_BLOCKS:
                break
        if not first:
            raise ValueError(f"{self.path}: the dump is empty")
        if not keys:  # every row so far is bad and the file has no more
            bad = [MalformedRow(line, str(obj)) for block in first for line, obj, _ in block]
            raise _all_malformed(self.path, bad)
        return keys, first, blocks

    def _parquet_source(self, wanted: dict[str, str]) -> tuple[set[str], Iterator]:
        import pyarrow.parquet as pq

        try:
            handle = pq.ParquetFile(self._stream, pre_buffer=False)  # pre-buffering kept every row group read
            keys = set(handle.schema_arrow.names)
        except Exception as err:  # pyarrow's own errors (not a Parquet file, truncated) and OSError
            raise ValueError(f"{self.path}: cannot read as Parquet ({str(err).splitlines()[0]})") from None
        if handle.metadata.num_rows == 0:
            raise ValueError(f"{self.path}: the dump is empty")
        self._handle = handle
        wanted_names = {_resolve(role, name, keys) for role, name in wanted.items()}
        columns = sorted(keys & ({*wanted_names, *self.extra_fields, CORRECTION_FIELD} - {None}))

        def batches() -> Iterator:
            try:
                yield from handle.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns, use_threads=False)
            except Exception as err:  # a corrupt row group further on
                raise ValueError(f"{self.path}: cannot read as Parquet ({str(err).splitlines()[0]})") from None

        return keys, batches()

    def first_correction(self) -> dict[str, Any] | None:
        """The correction the first rows record (``CORRECTION_FIELD``; the first block read, or the first row
        group of a Parquet file), None when they record none: the config is chosen from it before the rows are
        read on (``info().corrections_seen`` says at the end whether every row agreed)."""
        if self._kind == "parquet":
            if CORRECTION_FIELD not in self._handle.schema_arrow.names:
                return None
            values = self._handle.read_row_group(0, columns=[CORRECTION_FIELD]).column(0).to_pylist()
            return next((c for c in values if type(c) is dict), None)
        for block in self._first:
            for _, obj, _ in block:
                if isinstance(obj, dict) and type(obj.get(CORRECTION_FIELD)) is dict:
                    return obj[CORRECTION_FIELD]
        return None

    # -- blocks and chunks -------------------------------------------------------------------------------
    def blocks(self) -> Iterator[_Rows]:
        """The valid rows block by block (file order within and across blocks); raises ``ValueError`` at the
        end when no row was usable."""
        if self._used:
            raise RuntimeError("a DumpReader can be iterated once")
        self._used = True
        if self._kind == "parquet":
            first_row = 1
            for batch in self._source:
                rows = self._arrow_block(batch, first_row)
                first_row += batch.num_rows
                if rows is not None and len(rows):
                    yield rows
        else:
            decoded_rest = ([(line, raw if isinstance(raw, _BadRow) else _decode(raw), raw) for line, raw in block]
                            for block in self._source)
            for block in itertools.chain(self._first, decoded_rest):
                rows = self._object_block(block)
                if rows is not None and len(rows):
                    yield rows
            self._first = []
        for role in sorted(self._unresolved):
            name = self._wanted[role]
            if name != DEFAULT_FIELDS[role]:
                raise ValueError(f"{self.path}: no row has the {role} field {name!r}; fields present: {sorted(self._keys)}")
        if self.rows == 0:
            raise _all_malformed(self.path, self.malformed)

    def chunks(self, positions: int = CHUNK_POSITIONS, pool_tokens: int = POOL_TOKENS) -> Iterator[Dump]:
        """The valid rows as ``Dump`` chunks of at most ``positions`` padded positions (B × T; a longer row is a
        chunk of its own). Rows are pooled to ``pool_tokens`` tokens, sorted by length and cut, so a chunk's
        rows have similar lengths; ``Dump.row_index`` says where each row is in file order."""
        pool: list[_Rows] = []
        pooled = base = 0
        for block in self.blocks():
            pool.append(block)
            pooled += int(block.n.sum())
            if pooled >= pool_tokens:
                yield from self._cut(_concat_rows(pool, self.extra_fields), base, positions)
                base += sum(len(p) for p in pool)
                pool, pooled = [], 0
        if pool:
            yield from self._cut(_concat_rows(pool, self.extra_fields), base, positions)

    def _cut(self, rows: _Rows, base: int, positions: int) -> Iterator[Dump]:
        rank = np.empty(len(rows), np.int64)
        rank[np.argsort(rows.lines, kind="stable")] = np.arange(len(rows))
        order = np.argsort(rows.n, kind="stable")
        lengths = rows.n[order]
        a, total = 0, len(order)
        while a < total:
            lo, hi = a + 1, total  # the largest b with (b − a) × lengths[b − 1] ≤ positions (at least one row)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if (mid - a) * int(lengths[mid - 1]) <= positions:
                    lo = mid
                else:
                    hi = mid - 1
            sel = order[a:lo]
            yield _as_dump(rows, sel, self.path, self.fields, self.extra_fields, row_index=base + rank[sel])
            a = lo

    def info(self) -> DumpInfo:
        """The whole dump's facts (call once every block was read)."""
        distinct = list(self._corrections.values())
        complete = {role: self.rows > 0 and count == self.rows for role, count in self._having.items()}
        for role in ROUTED:
            complete[role] = complete[role] and len(self._route_shapes[role]) == 1
        shapes = {role: sorted(self._route_shapes[role]) for role in ROUTED}
        if all(complete[role] for role in ROUTED) and shapes["routed_experts"] != shapes["learner_routed_experts"]:
            complete["routed_experts"] = complete["learner_routed_experts"] = False
        routing_note = _routing_note(self._having, shapes, self.rows) if any(self._having[r] for r in ROUTED) else None
        return DumpInfo(
            path=self.path, fields=self.fields, malformed=self.malformed, total_rows=self.total_rows,
            rows=self.rows, num_tokens=self.num_tokens,
            partial={role: lines for role, lines in self._lacking.items() if self._having[role] > 0},
            correction=distinct[0] if len(distinct) == 1 else None, corrections_seen=len(distinct),
            complete=complete, extra_fields=self.extra_fields, routing_note=routing_note,
        )

    # -- one block ---------------------------------------------------------------------------------------
    def _count(self, rows: _Rows, bad: list[MalformedRow], read: int) -> None:
        """Book one block: rows read, malformed (in line order), usable rows and what they hold."""
        self.total_rows += read
        self.malformed.extend(sorted(bad, key=lambda m: m.line))
        self.rows += len(rows)
        self.num_tokens += int(rows.mask.sum())
        for role in PER_TOKEN:
            has = rows.has[role]
            self._having[role] += int(has.sum())
            if not has.all():
                self._lacking[role].extend(np.sort(rows.lines[~has]).tolist())
        for role, values in (("token_text", rows.token_text), ("text", rows.text)):
            self._having[role] += sum(v is not None for v in values)
        for role in ROUTED:
            for r in rows.routed[role]:
                if r is not None:
                    self._having[role] += 1
                    self._route_shapes[role].add(tuple(np.shape(r)[1:]) if len(r) else ())
        for c in rows.correction:
            if c is not None:
                self._corrections.setdefault(json.dumps(c, sort_keys=True), c)

    def _object_block(self, block: list) -> _Rows | None:
        """A block of decoded JSONL lines [(line, dict or _BadRow, raw bytes)] → its valid rows."""
        bad = [MalformedRow(line, str(obj)) for line, obj, _ in block if isinstance(obj, _BadRow)]
        good = [(line, obj, raw) for line, obj, raw in block if not isinstance(obj, _BadRow)]
        if self._unresolved:
            for _, obj, _ in good:
                self._keys.update(obj)
            for role in list(self._unresolved):
                if (name := _resolve(role, self._wanted[role], self._keys)) is not None:
                    self.names[role] = name
                    self._unresolved.discard(role)
            self.fields = {role: name for role, name in self.names.items() if name is not None}
        rows = self._check(
            _gather_objects([o for _, o, _ in good], np.array([g[0] for g in good], np.int64),
                            [r for _, _, r in good], self.names, self.extra_fields),
            lambda i: _decode_exact(good[i][2]), bad,
        )
        self._count(rows, bad, len(block))
        return rows

    def _arrow_block(self, batch, first_row: int) -> _Rows | None:
        """A Parquet record batch → its valid rows (Arrow's buffers; anything unusual through the objects)."""
        lines = np.arange(first_row, first_row + batch.num_rows, dtype=np.int64)
        gathered = _gather_arrow(batch, lines, self.names, self.extra_fields)
        objs = None

        def exact(i: int) -> Any:
            return batch.slice(i, 1).to_pylist()[0]

        if gathered is None:
            objs = batch.to_pylist()
            gathered = _gather_objects(objs, lines, None, self.names, self.extra_fields)
        bad: list[MalformedRow] = []
        rows = self._check(gathered, (lambda i: objs[i]) if objs is not None else exact, bad)
        self._count(rows, bad, batch.num_rows)
        return rows

    def _check(self, g: _Gathered, exact: Callable[[int], Any], bad: list[MalformedRow]) -> _Rows:
        """Run the vectorised checks on a gathered block; rows any check flags go through ``_parse_row`` on the
        exact object (``exact(i)``), which gives their reason or their values."""
        suspect = _value_checks(g)
        rows = _take_rows(g.rows, np.flatnonzero(~suspect)) if suspect.any() else g.rows
        extra: list[_Rows] = []
        for i in np.flatnonzero(suspect).tolist():
            line = int(g.rows.lines[i])
            obj = exact(i)
            try:
                if isinstance(obj, _BadRow):
                    raise obj
                if not isinstance(obj, dict):
                    raise _BadRow(f"expected a JSON object, got {type(obj).__name__}")
                extra.append(_rows_of_parsed(_parse_row(obj, self.names, self.extra_fields), line, self.extra_fields))
            except _BadRow as err:
                bad.append(MalformedRow(line, str(err)))
        if extra:
            rows = _concat_rows([rows, *extra], self.extra_fields)
        return rows


def _all_malformed(path: Path, malformed: list[MalformedRow]) -> ValueError:
    shown = "; ".join(f"line {m.line}: {m.reason}" for m in malformed[:5])
    more = " ..." if len(malformed) > 5 else ""
    return ValueError(f"{path}: all {len(malformed)} rows are malformed ({shown}{more})")


def _resolve(role: str, name: str, keys_seen: set[str]) -> str | None:
    """The field name to read for ``role``: ``name`` if present, else (for a default name) a known alias."""
    if name in keys_seen:
        return name
    if name == DEFAULT_FIELDS[role]:
        for alias in FIELD_ALIASES[role]:
            if alias in keys_seen:
                return alias
    return None


