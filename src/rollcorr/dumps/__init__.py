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

from rollcorr.dumps.format import (
    CORRECTION_FIELD,
    DEFAULT_FIELDS,
    FIELD_ALIASES,
    PER_TOKEN,
    ROUTED,
    STDIN,
    Dump,
    DumpInfo,
    MalformedRow,
    correction_record,
    display_name,
    write_dump,
)
from rollcorr.dumps.gather import POSITIVE_TOL
from rollcorr.dumps.reader import (
    CHUNK_POSITIONS,
    FIRST_BLOCKS,
    PARQUET_BATCH_ROWS,
    POOL_TOKENS,
    DumpReader,
    open_dump,
    read_dump,
)
from rollcorr.dumps.streams import READ_BYTES

__all__ = [
    "CHUNK_POSITIONS", "CORRECTION_FIELD", "DEFAULT_FIELDS", "FIELD_ALIASES", "FIRST_BLOCKS", "PARQUET_BATCH_ROWS",
    "PER_TOKEN", "POOL_TOKENS", "POSITIVE_TOL", "READ_BYTES", "ROUTED", "STDIN", "Dump", "DumpInfo", "DumpReader",
    "MalformedRow", "correction_record", "display_name", "open_dump", "read_dump", "write_dump",
]
