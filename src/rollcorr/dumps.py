"""The rollout dump: the on-disk format (JSONL or Parquet, one response per row) that ``write_dump`` writes (the
TRL drop-in, a verl run: docs/verl.md) and ``rollcorr analyze`` and ``rollcorr audit --from-log`` read, block by
block, as padded (B, T) chunks. It lives below the apps, which all share it (docs/architecture.md).

A dump row holds per-token lists for one response: the sampler's log-probs (log μ), the learner's log-probs
(log π_old) and optionally a mask, advantages, token ids, token texts and per-token weight versions::

    {"rollout_log_probs": [-0.1, -2.3], "old_log_probs": [-0.12, -2.1], "response_mask": [1, 1], ...}

Rows that cannot be used (bad JSON, a missing field, lists of different lengths, NaN/inf or positive
log-probs on valid tokens, no valid token) are skipped and reported with their line number; the rest of the
file still counts. When the configured field name is the default and absent from the file, the reader looks
for the names other frameworks use (``FIELD_ALIASES``) and records what it picked in ``Dump.fields``.

Two ways in:

- ``read_dump(path)``: the whole dump as one ``Dump``, right-padded to its longest row (for code that wants
  the tensors; memory grows with rows × longest row).
- ``open_dump(path)`` → ``DumpReader``: ``reader.chunks()`` yields the valid rows as ``Dump`` chunks of at most
  ``CHUNK_POSITIONS`` padded positions (rows are grouped by length, so one long row does not pad the short
  ones; a row longer than the budget is a chunk of its own). Memory: one read block of rows and one chunk at a
  time, plus the per-row bookkeeping (line numbers of rows lacking an optional field). ``rollcorr analyze``
  and ``rollcorr audit --from-log`` read this way.

Rows are checked column by column: JSON lines are decoded with orjson, each row's lists are converted in one C
call each (``array``) and joined into one numpy array per field and block, and the checks run on the arrays; a
row any check flags goes through the exact per-row checks (``_parse_row``, the standard library's ``json``),
which give the reason reported. Parquet is read in record batches (``iter_batches``), list columns straight
from Arrow's buffers by numpy (offsets, validity bitmaps, values; neither ``pyarrow.compute`` nor pandas is
imported).

The log-prob fields (and every alias choice) are resolved from the keys of the first blocks of rows (JSONL: read
until a block holds both log-prob fields, ``FIRST_BLOCKS`` × ``READ_BYTES`` at most; Parquet: the schema); an
optional field first seen further on is read from there on. So in a file whose first rows name a field differently from later ones, the later rows are reported
malformed ("missing field"), where a whole-file reading would have picked the later name.
"""

from __future__ import annotations

import array
import contextlib
import gzip
import itertools
import json
import math
import shutil
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

try:
    import orjson
except ImportError:  # pragma: no cover - a declared dependency; without it the standard library decodes the rows
    orjson = None

# Log-probs in (0, POSITIVE_TOL] are rounding noise of a probability ~1 and are clamped to 0; larger
# positive values are a broken row (a probability above 1).
POSITIVE_TOL = 1e-3

CHUNK_POSITIONS = 1 << 17  # padded positions (rows × longest row) of one chunk
POOL_TOKENS = 1 << 19  # valid rows gathered (in tokens) before they are grouped by length into chunks
READ_BYTES = 1 << 22  # JSONL bytes decoded at a time
PARQUET_BATCH_ROWS = 512  # rows per Parquet record batch
FIRST_BLOCKS = 16  # JSONL blocks read, at most, to find the log-prob fields before saying they are absent

# role -> names tried in order when the default name is absent from the file (first is rollcorr's default).
FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "rollout": (
        "rollout_log_probs",  # verl, slime, SkyRL
        "rollout_log_prob",  # rollcorr
        "generation_logprobs",  # NeMo-RL
        "sampling_per_token_logps",  # TRL
        "inference_logprobs",  # prime-rl
        "infer_logprobs",
        "rollout_logprobs",
        "logprobs",  # AReaL (the inference engine's log-probs, beside prox_logp)
        "response_logprobs",  # verl's AgentLoopOutput (rollout_log_probs once in the batch)
    ),
    "learner": (
        "old_log_probs",  # verl, slime, SkyRL, OpenRLHF
        "old_log_prob",  # rollcorr
        "prev_logprobs",  # NeMo-RL
        "old_per_token_logps",  # TRL
        "prox_logp",  # AReaL
        "trainer_logprobs",  # prime-rl
    ),
    "mask": ("response_mask", "token_mask", "loss_mask", "completion_mask", "mask"),
    "advantages": ("advantages", "advantage"),
    "tokens": ("responses", "response_ids", "completion_ids", "token_ids"),
    "token_text": ("token_text", "token_texts", "response_tokens_text"),
    "text": ("response_text", "response", "completion"),
    "version": ("version", "versions", "token_versions"),
    # multi-turn: the model turn each token belongs to (rollcorr's Rollout.turn); without it a turn is a run of
    # mask-1 tokens (rollcorr.turns)
    "turn": ("turn", "turns"),
    # mixture of experts: per token, per MoE layer, the top-k expert ids (rollcorr.moe)
    "routed_experts": (
        "routed_experts",  # rollcorr, verl (router_replay R3), NeMo-RL, vLLM's enable_return_routed_experts
        "rollout_expert_indices",  # SkyRL
    ),
    "learner_routed_experts": ("learner_routed_experts",),  # rollcorr: the learner's own choice
}

DEFAULT_FIELDS = {role: names[0] for role, names in FIELD_ALIASES.items()}
CORRECTION_FIELD = "correction"  # the CorrectionConfig that produced the row (keys differing from the default)
PER_TOKEN = ("advantages", "tokens", "version", "turn")  # optional per-token numeric fields (``Dump.partial``)
ROUTED = ("routed_experts", "learner_routed_experts")
STDIN = "-"


@dataclass(frozen=True)
class MalformedRow:
    """A skipped row: its 1-based line (JSONL) or row (Parquet) number and why it was skipped."""

    line: int
    reason: str


@dataclass
class Dump:
    """Valid rows of a dump (or of one chunk of it), right-padded to (B, T).

    rollout_log_prob  (B, T) float64, log μ of each response token, 0 on padding
    learner_log_prob  (B, T) float64, the learner's log-prob of each response token, 0 on padding: π_old in
                      decoupled mode; in bypass mode it stands in for π_θ (files name it old_log_probs, ...)
    response_mask     (B, T) bool, True on valid tokens (from the mask field, else from list lengths)
    advantages        (B, T) float64 or None (a scalar per row is broadcast over its tokens)
    tokens            (B, T) int64 response token ids or None
    token_text        per-row lists of per-token strings, or None
    text              per-row response strings, or None
    version           (B, T) int64 weight version per token, or None
    turn              (B, T) int64 the model turn of each token (multi-turn trajectories), or None
    routed_experts    (B, T, L, k) int64 the sampler's experts per response token and MoE layer, or None
    learner_routed_experts  (B, T, L, k) int64 the learner's own experts for the same tokens, or None
    line_numbers      source line (JSONL) / row (Parquet) of each of the B rows, 1-based
    extras            extra field name -> per-row values (None where a row lacks it)
    malformed         skipped rows with line numbers and reasons
    fields            role -> field name actually read ("rollout", "learner", "mask", ...)
    partial           role -> lines lacking a per-token field other rows have (that field is then None)
    correction        the CorrectionConfig keys the writer recorded (``CORRECTION_FIELD``; the keys that differ
                      from ``CorrectionConfig()``), when every row that records one records the same; else None
    corrections_seen  how many different correction configs the rows record (0: none recorded)
    row_index         (B,) int64: each row's place among the dump's valid rows in file order (a chunk's rows
                      are grouped by length, not in file order); None means 0 … B − 1
    """

    path: Path
    rollout_log_prob: Tensor
    learner_log_prob: Tensor
    response_mask: Tensor
    line_numbers: list[int]
    fields: dict[str, str]
    malformed: list[MalformedRow] = field(default_factory=list)
    advantages: Tensor | None = None
    tokens: Tensor | None = None
    token_text: list[list[str]] | None = None
    text: list[str] | None = None
    version: Tensor | None = None
    routed_experts: Tensor | None = None
    learner_routed_experts: Tensor | None = None
    extras: dict[str, list[Any]] = field(default_factory=dict)
    turn: Tensor | None = None
    total_rows: int = 0
    partial: dict[str, list[int]] = field(default_factory=dict)
    correction: dict[str, Any] | None = None
    corrections_seen: int = 0
    row_index: Tensor | None = None

    def __len__(self) -> int:
        return self.rollout_log_prob.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    def to_rollout(self):
        """The dump as a :class:`rollcorr.rollout.Rollout` (float32 log-probs; no prompts, one group per row)."""
        from rollcorr.rollout import Rollout

        b, t = self.rollout_log_prob.shape
        tokens = self.tokens if self.tokens is not None else torch.zeros(b, t, dtype=torch.long)
        version = self.version if self.version is not None else torch.zeros(b, t, dtype=torch.long)
        meta = [{"line": line} for line in self.line_numbers]
        if self.text is not None:
            for m, text in zip(meta, self.text):
                m["response_text"] = text
        return Rollout(
            prompt_ids=torch.zeros(b, 0, dtype=torch.long),
            prompt_mask=torch.zeros(b, 0, dtype=torch.bool),
            response_ids=tokens,
            response_mask=self.response_mask,
            rollout_log_prob=self.rollout_log_prob.float(),
            version=version,
            group_ids=torch.arange(b),
            meta=meta,
            old_log_prob=self.learner_log_prob.float(),
            advantages=None if self.advantages is None else self.advantages.float(),
            routed_experts=self.routed_experts,
        )


@dataclass
class DumpInfo:
    """What a ``DumpReader`` learned about the whole dump once every block was read (``Dump``'s names for
    the same facts): rows read, usable rows and tokens, malformed rows, fields, partial per-token fields, the
    recorded correction, and which optional fields every usable row has."""

    path: Path
    fields: dict[str, str]
    malformed: list[MalformedRow]
    total_rows: int
    rows: int
    num_tokens: int
    partial: dict[str, list[int]]
    correction: dict[str, Any] | None
    corrections_seen: int
    complete: dict[str, bool]  # role -> every usable row has it (token_text, text, tokens, advantages, ...)
    extra_fields: tuple[str, ...] = ()
    routing_note: str | None = None  # why the routing of the dump cannot be compared (or None when it can)

    def __len__(self) -> int:
        return self.rows


class _BadRow(Exception):
    """Raised while parsing one row; the message is the reason reported to the user."""


def display_name(path: Path) -> str:
    """How a dump is named in reports: its file name, or "stdin" for ``-``."""
    return "stdin" if str(path) == STDIN else path.name


# ---- validated rows, stored flat ------------------------------------------------------------------------
@dataclass
class _Rows:
    """Valid rows of one block, flat: row i holds tokens ``starts[i] : starts[i] + n[i]`` of each array.

    Per-token arrays are aligned with ``rollout`` (0 where a row lacks the field, ``has[role]`` says which
    rows have it); ``token_text``, ``text``, ``routed[role]``, ``extras[key]`` and ``correction`` hold one
    Python value per row (None where absent)."""

    lines: np.ndarray  # (R,) int64
    n: np.ndarray  # (R,) int64 list length (valid tokens and mask-0 positions)
    rollout: np.ndarray  # float64, 0 at mask-0 positions
    learner: np.ndarray  # float64, 0 at mask-0 positions
    mask: np.ndarray  # bool
    numeric: dict[str, np.ndarray]  # "advantages" float64 (0 at mask-0), "tokens" / "version" / "turn" int64
    has: dict[str, np.ndarray]  # role -> (R,) bool
    token_text: list
    text: list
    routed: dict[str, list]
    extras: dict[str, list]
    correction: list

    def __len__(self) -> int:
        return len(self.lines)

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.n) - self.n


def _segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat indices of the segments ``starts[i] : starts[i] + lengths[i]``, concatenated."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    first = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) + np.repeat(starts - first, lengths)


def _concat_rows(parts: list[_Rows], extra_fields: Sequence[str]) -> _Rows:
    """One ``_Rows`` of several (in the order given)."""
    if len(parts) == 1:
        return parts[0]
    sizes = [int(p.n.sum()) for p in parts]

    def numeric(role: str, dtype) -> np.ndarray:
        return np.concatenate([p.numeric[role] if role in p.numeric else np.zeros(s, dtype)
                               for p, s in zip(parts, sizes)])  # fmt: skip

    roles = {role for p in parts for role in p.numeric}
    return _Rows(
        lines=np.concatenate([p.lines for p in parts]),
        n=np.concatenate([p.n for p in parts]),
        rollout=np.concatenate([p.rollout for p in parts]),
        learner=np.concatenate([p.learner for p in parts]),
        mask=np.concatenate([p.mask for p in parts]),
        numeric={role: numeric(role, np.float64 if role == "advantages" else np.int64) for role in roles},
        has={role: np.concatenate([p.has[role] for p in parts]) for role in parts[0].has},
        token_text=[x for p in parts for x in p.token_text],
        text=[x for p in parts for x in p.text],
        routed={role: [x for p in parts for x in p.routed[role]] for role in ROUTED},
        extras={key: [x for p in parts for x in p.extras[key]] for key in extra_fields},
        correction=[x for p in parts for x in p.correction],
    )


def _take_rows(rows: _Rows, sel: np.ndarray) -> _Rows:
    """The rows ``sel`` (indices) of ``rows``, flat again."""
    idx = _segments(rows.starts[sel], rows.n[sel])
    pick = sel.tolist()
    return _Rows(
        lines=rows.lines[sel], n=rows.n[sel], rollout=rows.rollout[idx], learner=rows.learner[idx],
        mask=rows.mask[idx], numeric={k: v[idx] for k, v in rows.numeric.items()},
        has={k: v[sel] for k, v in rows.has.items()}, token_text=[rows.token_text[i] for i in pick],
        text=[rows.text[i] for i in pick], routed={k: [v[i] for i in pick] for k, v in rows.routed.items()},
        extras={k: [v[i] for i in pick] for k, v in rows.extras.items()}, correction=[rows.correction[i] for i in pick],
    )  # fmt: skip


def _pad_index(rows: _Rows, sel: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices into a (len(sel), t) array, flat indices into the rows' arrays) placing rows ``sel``'s
    segments right-padded."""
    lengths = rows.n[sel]
    within = _segments(np.zeros(len(sel), np.int64), lengths)  # the position within each row
    return np.repeat(np.arange(len(sel), dtype=np.int64) * t, lengths) + within, _segments(rows.starts[sel], lengths)


def _as_dump(rows: _Rows, sel: np.ndarray, path: Path, fields: dict[str, str], extra_fields: Sequence[str],
             row_index: np.ndarray | None = None) -> Dump:  # fmt: skip
    """The rows ``sel`` of ``rows`` as a ``Dump`` padded to their longest row (per-token fields, texts and
    routing kept only when every one of these rows has them)."""
    t = int(rows.n[sel].max())
    pick = sel.tolist()
    dst, src = _pad_index(rows, sel, t)

    def tensor(flat: np.ndarray) -> Tensor:
        out = np.zeros(len(sel) * t, dtype=flat.dtype)
        out[dst] = flat[src]
        return torch.from_numpy(out.reshape(len(sel), t))

    def numeric(role: str) -> Tensor | None:
        if role not in rows.numeric or not rows.has[role][sel].all():
            return None
        return tensor(rows.numeric[role])

    def every(values: list) -> list | None:
        chosen = [values[i] for i in pick]
        return chosen if all(v is not None for v in chosen) else None

    return Dump(
        path=path,
        rollout_log_prob=tensor(rows.rollout),
        learner_log_prob=tensor(rows.learner),
        response_mask=tensor(rows.mask),
        line_numbers=rows.lines[sel].tolist(),
        fields=fields,
        advantages=numeric("advantages"),
        tokens=numeric("tokens"),
        token_text=every(rows.token_text),
        text=every(rows.text),
        version=numeric("version"),
        turn=numeric("turn"),
        routed_experts=_routing_tensor([rows.routed["routed_experts"][i] for i in pick], t),
        learner_routed_experts=_routing_tensor([rows.routed["learner_routed_experts"][i] for i in pick], t),
        extras={key: [rows.extras[key][i] for i in pick] for key in extra_fields},
        row_index=None if row_index is None else torch.from_numpy(np.ascontiguousarray(row_index)),
    )


def _routing_tensor(rows: list, t: int) -> Tensor | None:
    """(B, T, L, k) int64 routed experts when every row has them with one shape, else None."""
    if not rows or any(r is None for r in rows):
        return None
    shapes = {tuple(torch.as_tensor(r).shape[1:]) for r in rows}
    if len(shapes) != 1:
        return None
    out = torch.zeros(len(rows), t, *shapes.pop(), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r)
    return out


# ---- the reader ---------------------------------------------------------------------------------------------
def _wanted(rollout_field: str, learner_field: str, mask_field: str, advantages_field: str, tokens_field: str,
            token_text_field: str, text_field: str, version_field: str, routed_experts_field: str,
            fields: dict[str, str] | None) -> dict[str, str]:  # fmt: skip
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
    if fields:
        unknown = set(fields) - set(wanted)
        if unknown:
            raise ValueError(f"unknown field role(s) {sorted(unknown)}; roles are {sorted(wanted)}")
        wanted.update(fields)
    return wanted


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
    fails before any row is analysed. Same arguments and errors as ``read_dump``."""
    wanted = _wanted(rollout_field, learner_field, mask_field, advantages_field, tokens_field, token_text_field,
                     text_field, version_field, routed_experts_field, fields)  # fmt: skip
    return DumpReader(path, wanted, extra_fields)


def read_dump(
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
) -> Dump:
    """Read a JSONL (``.jsonl``, ``.jsonl.gz``, anything else) or Parquet (``.parquet``/``.pq``) rollout dump
    whole, right-padded to its longest row (``open_dump`` reads it chunk by chunk instead).

    ``fields`` maps roles ("rollout", "learner", "mask", "advantages", "tokens", "token_text", "text",
    "version") to names and overrides the keyword arguments. Raises ``FileNotFoundError`` for a missing
    file and ``ValueError`` when no row is usable or a required field is in no row.
    """
    wanted = _wanted(rollout_field, learner_field, mask_field, advantages_field, tokens_field, token_text_field,
                     text_field, version_field, routed_experts_field, fields)  # fmt: skip
    reader = DumpReader(path, wanted, extra_fields)
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
                                 f"{sorted(keys)}")  # fmt: skip
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
                            for block in self._source)  # fmt: skip
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
        )  # fmt: skip

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
        )  # fmt: skip
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


# ---- sources: files, standard input, FIFOs -----------------------------------------------------------------
def _open_source(path: str | Path) -> tuple[Path, str, Any, bool]:
    """(the path as reported, "jsonl" | "parquet", a binary stream, gzip?). ``-`` is standard input; a FIFO or
    character device (``<(cat f)``, ``/dev/stdin``) is read as a stream. Parquet (by suffix, or the ``PAR1``
    magic bytes) that is not seekable is copied to a temporary file first (its index sits at the end)."""
    if str(path) == STDIN:
        label, stream = Path(STDIN), _stdin()
        if stream is None:
            raise ValueError("-: standard input is closed, so there is no dump to read; give the dump's path")
    else:
        label = Path(path)
        if label.is_dir():
            raise ValueError(f"{label}: is a directory, not a rollout dump")
        if not label.exists():
            raise FileNotFoundError(f"rollout dump not found: {label}")
        try:
            stream = label.open("rb")
        except OSError as err:
            raise ValueError(f"{label}: cannot read ({err.strerror or err})") from None
    suffix = label.suffix.lower()
    try:
        head = stream.peek(4)[:4]
    except OSError as err:
        raise ValueError(f"{label}: cannot read ({err.strerror or err})") from None
    parquet = suffix in (".parquet", ".pq") or head == b"PAR1"
    if parquet:
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError as err:
            raise ImportError(
                f"reading the Parquet dump {label} needs pyarrow: pip install 'rollcorr[parquet]'"
            ) from err
        if not stream.seekable():
            spool = tempfile.TemporaryFile()
            shutil.copyfileobj(stream, spool, 1 << 20)
            spool.seek(0)
            stream = spool
        return label, "parquet", stream, False
    gz = "".join(label.suffixes[-2:]).lower().endswith(".gz") or head[:2] == b"\x1f\x8b"
    return label, "jsonl", stream, gz


def _stdin() -> Any:
    """Standard input's binary stream; None when the process was started with it closed (``0<&-``)."""
    return getattr(sys.stdin, "buffer", None)


def _jsonl_blocks(stream, gz: bool, path: Path) -> Iterator[list[tuple[int, bytes | _BadRow]]]:
    """Blocks of (1-based line number, raw line or a ``_BadRow`` where a .gz broke); blank lines skipped, a
    leading UTF-8 byte-order mark dropped."""
    line = 0
    for lines in _line_blocks(stream, gz, path):
        if isinstance(lines, _BadRow):
            yield [(line + 1, lines)]
            return
        out = []
        for raw in lines:
            line += 1
            if line == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if raw and not raw.isspace():
                out.append((line, raw))
        if out:
            yield out


def _line_blocks(stream, gz: bool, path: Path) -> Iterator[list[bytes] | _BadRow]:
    """The stream's lines (without ``\\n``), ``READ_BYTES`` at a time; a gzip stream is inflated chunk by chunk
    so every line before a truncation or corruption is still read (then one ``_BadRow`` says where it broke)."""
    with contextlib.nullcontext(stream) if stream is _stdin() else stream:
        pending: list[bytes] = []

        def split(data: bytes) -> list[bytes]:
            if b"\n" not in data:
                pending.append(data)
                return []
            lines = data.split(b"\n")
            if pending:
                lines[0] = b"".join([*pending, lines[0]])
            pending[:] = [lines.pop()]
            return lines

        try:
            if not gz:
                held: list[bytes] = []  # one block held back, so the last line (no \n) joins the block before it
                while data := stream.read(READ_BYTES):
                    if lines := split(data):
                        if held:
                            yield held
                        held = lines
                if rest := b"".join(pending):
                    held.append(rest)
                if held:
                    yield held
                return
            inflate, started = zlib.decompressobj(16 + zlib.MAX_WBITS), False
            while True:
                chunk = stream.read(max(READ_BYTES // 8, 1 << 12))  # compressed: ~READ_BYTES once inflated
                try:
                    data = inflate.decompress(chunk) if chunk else inflate.flush()
                    while inflate.eof and inflate.unused_data:  # a multi-member gzip file (cat a.gz b.gz)
                        rest = inflate.unused_data
                        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
                        data += inflate.decompress(rest)
                except zlib.error as err:
                    if not started:
                        raise ValueError(
                            f"{path}: not a gzip file ({err}); if it is plain JSONL, drop the .gz"
                        ) from None
                    if lines := split(b""):
                        yield lines
                    yield _BadRow(f"the compressed data is corrupt from here ({err}); the rows before it are read")
                    return
                started = True
                if lines := split(data):
                    yield lines
                if not chunk:
                    break
            if not inflate.eof:
                yield _BadRow("the compressed file ends early (truncated); the rows before it are read")
            elif rest := b"".join(pending):
                yield [rest]
        except OSError as err:
            raise ValueError(f"{path}: cannot read ({err.strerror or err})") from None


def _decode(raw: bytes) -> Any:
    """One JSONL line → a dict or a ``_BadRow`` (orjson; what it refuses, the standard library decides)."""
    if orjson is None:
        obj = _decode_exact(raw)
    else:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = _decode_exact(raw)
    if isinstance(obj, dict | _BadRow):
        return obj
    return _BadRow(f"expected a JSON object, got {type(obj).__name__}")


def _decode_exact(raw: bytes) -> Any:
    """One JSONL line as the standard library reads it (NaN, integers of any size), or a ``_BadRow``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return _BadRow(f"invalid UTF-8 at byte {err.start}")
    try:
        return json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as err:
        return _BadRow(f"bad JSON: {err.msg} (column {err.colno})")
    except (ValueError, RecursionError) as err:  # e.g. an integer literal with > 4300 digits
        return _BadRow(f"bad JSON: {str(err).splitlines()[0]}")


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
                  suspect: np.ndarray) -> None:  # fmt: skip
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
                    extra_fields: Sequence[str]) -> _Gathered:  # fmt: skip
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
                if name is not None]  # fmt: skip
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
        strict = None  # the line holds true / false: computed when an optional list needs it
        try:
            for role, name, kinds in optional:
                value = obj.get(name)
                if value is None:
                    continue
                if role == "advantages" and type(value) in (float, int):
                    numeric_rows[role][i] = [float(value)] * k  # OverflowError: past float range
                    adv_scalar[i] = True
                elif type(value) is list and len(value) == k:
                    if strict is None:
                        strict = raws is None or b"true" in raws[i] or b"false" in raws[i]
                    if strict and not _only(value, kinds):
                        raise _BadRow
                    numeric_rows[role][i] = value
                else:
                    raise _BadRow
            if ttn is not None and (tt := obj.get(ttn)) is not None:
                if type(tt) is not list or len(tt) != k or not _only(tt, _STR):
                    raise _BadRow
                token_text[i] = tt
            for role, name in routed_names:
                if obj.get(name) is not None:
                    routed[role][i] = _routing_rows(obj, name, k)
        except (_BadRow, OverflowError):
            suspect[i] = True
            for role in numeric_rows:
                numeric_rows[role][i] = None
            token_text[i] = routed["routed_experts"][i] = routed["learner_routed_experts"][i] = None
            continue
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
                 token_text=token_text, text=text, routed=routed, extras=extras, correction=correction)  # fmt: skip
    return _Gathered(rows, suspect, adv_scalar)


def _aligned(per_row: list, starts: np.ndarray, n: np.ndarray, suspect: np.ndarray, total: int, kind: str,
             fill: float = 0) -> np.ndarray:  # fmt: skip
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


def _gather_arrow(batch, lines: np.ndarray, names: dict[str, str | None], extra_fields: Sequence[str]) -> _Gathered | None:
    """A Parquet record batch → columns, straight from Arrow's buffers; None when a column is of a kind this
    does not read (then the batch goes through its Python rows)."""
    import pyarrow as pa

    size = batch.num_rows
    schema = batch.schema

    def column(name):
        return batch.column(schema.get_field_index(name)) if name is not None and name in schema.names else None

    def is_list(col) -> bool:
        """A list column of numbers or bools (those may be a mask)."""
        t = col.type
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
            return False
        v = t.value_type
        return pa.types.is_integer(v) or pa.types.is_floating(v) or pa.types.is_boolean(v)

    r_col, l_col = column(names["rollout"]), column(names["learner"])
    if r_col is None or l_col is None or not is_list(r_col) or not is_list(l_col):
        return None
    if pa.types.is_boolean(r_col.type.value_type) or pa.types.is_boolean(l_col.type.value_type):
        return None

    def offsets(col) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # the offsets buffer, read by numpy (``Array.to_numpy`` would import pandas)
        width = np.int64 if pa.types.is_large_list(col.type) else np.int32
        off = np.frombuffer(col.buffers()[1], width, count=col.offset + len(col) + 1)[col.offset :].astype(np.int64)
        return off, np.diff(off), _arrow_nulls(col)

    def values(col, off, dtype) -> tuple[np.ndarray, np.ndarray | None]:
        """(the list entries as ``dtype``: NaN at null entries for float64, anything for int64; where the nulls
        are, or None)"""
        v = col.values.slice(int(off[0]), int(off[-1] - off[0]))
        nulls = _arrow_nulls(v) if v.null_count else None
        out = _arrow_numbers(v, dtype)
        if nulls is not None and dtype == np.float64:
            out[nulls] = np.nan
        return out, nulls

    r_off, n, r_null = offsets(r_col)
    l_off, l_n, l_null = offsets(l_col)
    suspect = r_null | l_null | (n == 0) | (l_n != n)
    n = np.where(suspect, 0, n)
    starts = np.cumsum(n) - n
    total = int(n.sum())
    ok = np.flatnonzero(~suspect)

    def place(col, dtype, fill=0, kind="numbers"):
        """(aligned flat values, has (R,)) of a per-token column, marking rows with a list of another length
        (or, for integers and masks, a null entry) in ``suspect``."""
        off, ln, null = offsets(col)
        has = ~null & ~suspect
        wrong = has & (ln != n)
        suspect[wrong] = True
        has &= ~wrong
        vals, nulls = values(col, off, dtype)
        out = np.full(total, fill, dtype=dtype)
        sel = np.flatnonzero(has)
        src = _segments(off[sel] - off[0], n[sel])
        if nulls is not None and kind != "numbers":
            null_rows = np.unique(np.repeat(sel, n[sel])[nulls[src]])
            suspect[null_rows] = True
        if kind == "binary":
            bad = ~((vals[src] == 0) | (vals[src] == 1))
            if bad.any():
                suspect[np.unique(np.repeat(sel, n[sel])[bad])] = True
        out[_segments(starts[sel], n[sel])] = vals[src]
        return out, has

    r_vals, _ = values(r_col, r_off, np.float64)
    l_vals, _ = values(l_col, l_off, np.float64)
    rollout = r_vals[_segments(r_off[ok] - r_off[0], n[ok])]
    learner = l_vals[_segments(l_off[ok] - l_off[0], n[ok])]
    mask = np.ones(total, np.float64)
    m_col = column(names["mask"])
    if m_col is not None:
        if not is_list(m_col):
            return None
        mask, _ = place(m_col, np.float64, fill=1.0, kind="binary")
    numeric, has = {}, {}
    adv_scalar = np.zeros(size, bool)
    for role, dtype in (("advantages", np.float64), ("tokens", np.int64), ("version", np.int64), ("turn", np.int64)):
        col = column(names[role])
        has[role] = np.zeros(size, bool)
        if col is None:
            continue
        if role == "advantages" and (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
            has[role] = ~_arrow_nulls(col) & ~suspect
            per_row = _arrow_numbers(col, np.float64)
            numeric[role] = np.repeat(np.where(has[role], per_row, 0.0), n)
            adv_scalar = has[role].copy()
            continue
        if not is_list(col) or pa.types.is_boolean(col.type.value_type):
            return None  # e.g. a string column, bools: the Python rows say what is wrong
        if role != "advantages" and not pa.types.is_signed_integer(col.type.value_type):
            return None  # floats or uint64 ids: not "integers within int64" row by row
        numeric[role], has[role] = place(col, dtype, kind="numbers" if role == "advantages" else "ints")
        if not has[role].any():
            del numeric[role]
    token_text: list = [None] * size
    col = column(names["token_text"])
    if col is not None:
        for i, tt in enumerate(col.to_pylist()):
            if tt is None or suspect[i]:
                continue
            if type(tt) is not list or len(tt) != n[i] or not _only(tt, _STR):
                suspect[i] = True
            else:
                token_text[i] = tt
    col = column(names["text"])
    text = [x if type(x) is str else None for x in col.to_pylist()] if col is not None else [None] * size
    routed: dict[str, list] = {role: [None] * size for role in ROUTED}
    for role in ROUTED:
        col = column(names[role])
        if col is None:
            continue
        for i, value in enumerate(col.to_pylist()):
            if value is None or suspect[i]:
                continue
            try:
                routed[role][i] = _routing_rows({names[role]: value}, names[role], int(n[i]))
            except _BadRow:
                suspect[i] = True
    extras = {key: (column(key).to_pylist() if column(key) is not None else [None] * size) for key in extra_fields}
    col = column(CORRECTION_FIELD)
    correction = [c if type(c) is dict else None for c in col.to_pylist()] if col is not None else [None] * size
    for role in has:
        has[role] &= ~suspect
    rows = _Rows(lines=lines, n=n, rollout=rollout, learner=learner, mask=mask != 0, numeric=numeric, has=has,
                 token_text=token_text, text=text, routed=routed, extras=extras, correction=correction)  # fmt: skip
    return _Gathered(rows, suspect, adv_scalar)


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
    )  # fmt: skip


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
                      f"got shape {tuple(routes.shape)}")  # fmt: skip
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
                     f"{shapes['learner_routed_experts'][0]}")  # fmt: skip
    return ("routing not compared: " + "; ".join(parts)) if parts else None


# ---- writing ----------------------------------------------------------------------------------------
def write_dump(
    path: str | Path,
    rollout_log_prob: Tensor,
    learner_log_prob: Tensor,
    response_mask: Tensor,
    *,
    advantages: Tensor | None = None,
    tokens: Tensor | None = None,
    version: Tensor | None = None,
    turn: Tensor | None = None,
    routed_experts: Tensor | None = None,
    learner_routed_experts: Tensor | None = None,
    extras: dict[str, Sequence[Any]] | None = None,
    tokenizer: Any = None,
    correction: Any = None,
    append: bool = True,
) -> int:
    """Write a (B, T) right-padded batch as JSONL rows that ``read_dump`` / ``rollcorr analyze`` read.

    One row per response, under rollcorr's default field names (``rollout_log_probs``, ``old_log_probs`` for
    ``learner_log_prob``,
    ``response_mask`` and, when given, ``advantages`` ((B,) or (B, T)), ``responses`` (token ids),
    ``version``, ``turn``, ``routed_experts`` and ``learner_routed_experts`` ((B, T, L, k), one (L, k) list per
    token)), each list cut after the row's last valid token; a multi-turn rollout is written as it is, the
    environment's tokens kept in ``responses`` at mask-0 positions between the model's turns (verl's agent-loop
    layout) and ``turn`` the model turn of each token (``Rollout.turn``); ``extras`` maps a field name to one value
    per row (e.g. ``{"step": [3] * B, "reward": rewards}``). With ``tokenizer`` (and ``tokens``) each row also
    gets ``token_text`` (every token decoded alone) and ``response_text`` (the row decoded), so a reader needs
    no tokenizer; with ``correction`` (a ``CorrectionConfig``) each row records under ``correction`` the keys
    that differ from ``CorrectionConfig()``, which ``rollcorr analyze`` applies by default. ``.gz`` paths are
    gzip-compressed. With
    ``append`` the rows are added to an existing file (one file per run), else the file is replaced. The
    rows are encoded first and written in one call, so a bad input leaves the file untouched. Returns the
    number of rows written."""
    path = Path(path)
    shape = tuple(rollout_log_prob.shape)
    if len(shape) != 2:
        raise ValueError(f"rollout_log_prob must be (B, T), got shape {shape}")
    named = {"learner_log_prob": learner_log_prob, "response_mask": response_mask, "tokens": tokens, "version": version,
             "turn": turn}  # fmt: skip
    for name, value in named.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    routes = {"routed_experts": routed_experts, "learner_routed_experts": learner_routed_experts}
    for name, value in routes.items():
        if value is not None and (value.dim() != 4 or tuple(value.shape[:2]) != shape):
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape} × (layers, top_k)")
    if advantages is not None and tuple(advantages.shape) not in (shape, shape[:1]):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {shape[:1]} or {shape}")
    for name, values in (extras or {}).items():
        if len(values) != shape[0]:
            raise ValueError(f"extras[{name!r}] has {len(values)} values, expected one per row ({shape[0]})")
    if tokenizer is not None and tokens is None:
        raise ValueError("write_dump: tokenizer= decodes the token ids, so tokens= must be given too")
    recorded = None if correction is None else correction_record(correction)
    mask = response_mask.detach().bool().cpu()
    lengths = torch.where(mask.any(-1), shape[1] - mask.flip(-1).int().argmax(-1), 0).tolist()

    def cut(x: Tensor | None, b: int) -> list | None:
        return None if x is None else x[b, : lengths[b]].tolist()

    cpu = {k: None if v is None else v.detach().cpu() for k, v in named.items()}
    roll, adv = rollout_log_prob.detach().double().cpu(), None if advantages is None else advantages.detach().cpu()
    old = cpu["learner_log_prob"].double()
    lines = []
    for b in range(shape[0]):
        row: dict[str, Any] = {
            "rollout_log_probs": cut(roll, b),
            "old_log_probs": cut(old, b),
            "response_mask": [int(v) for v in mask[b, : lengths[b]].tolist()],
        }
        if adv is not None:
            row["advantages"] = float(adv[b]) if adv.dim() == 1 else cut(adv.double(), b)
        if cpu["tokens"] is not None:
            row["responses"] = cut(cpu["tokens"], b)
            if tokenizer is not None:
                ids = row["responses"]
                row["token_text"] = list(tokenizer.batch_decode([[i] for i in ids])) if ids else []
                row["response_text"] = tokenizer.decode(ids)
        if recorded is not None:
            row[CORRECTION_FIELD] = recorded
        if cpu["version"] is not None:
            row["version"] = cut(cpu["version"], b)
        if cpu["turn"] is not None:
            row["turn"] = cut(cpu["turn"], b)
        for name, value in routes.items():
            if value is not None:
                row[name] = value[b, : lengths[b]].detach().long().cpu().tolist()
        for name, values in (extras or {}).items():
            value = values[b]
            row[name] = value.item() if isinstance(value, Tensor) else value
        lines.append(json.dumps(row, allow_nan=False))
    text = "".join(line + "\n" for line in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "at" if append else "wt", encoding="utf-8") as f:
        f.write(text)
    return len(lines)



def correction_record(config: Any) -> dict[str, Any]:
    """The keys of a ``CorrectionConfig`` that differ from ``CorrectionConfig()`` (plain JSON data);
    ``CorrectionConfig.from_dict`` of it rebuilds the config."""
    from rollcorr.config.correction import CorrectionConfig

    if not isinstance(config, CorrectionConfig):
        raise ValueError(f"correction must be a CorrectionConfig, got {type(config).__name__}")
    default = CorrectionConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if v != default[k]}
