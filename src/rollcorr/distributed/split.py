"""Which rows of a batch each rank scores and backpropagates.

The optimizer walks mini-batches of consecutive rows (``train/step.py``); rank r takes the r-th of N equal,
contiguous slices of every mini-batch, so rank r's k-th local mini-batch is its share of the global k-th one
and the N ranks together take exactly the optimizer steps one process takes. A slice boundary never falls
inside a group (the responses to one prompt), so group baselines are those of one process; a split that
would cut a group is refused with the config keys to change.

    global rows  | g0 g0 g1 g1 | g2 g2 g3 g3 |     (mini_batches = 2, 2 rows per group)
    rank 0       | g0 g0       | g2 g2       |
    rank 1       |       g1 g1 |       g3 g3 |
"""

from __future__ import annotations

from torch import Tensor


class SplitError(ValueError):
    """The batch cannot be split into equal per-rank shares of whole groups."""


def mini_batch_rows(batch_size: int, mini_batches: int) -> list[list[int]]:
    """Rows of each mini-batch: ``mini_batches`` equal runs of consecutive rows."""
    size = batch_size // mini_batches
    return [list(range(i, i + size)) for i in range(0, batch_size, size)]


def rank_share(rows: list[int], group_ids: Tensor, rank: int, world: int) -> list[int]:
    """Rank ``rank``'s contiguous 1/``world`` of ``rows``; a ``SplitError`` if the cut splits a group."""
    if len(rows) % world:
        raise SplitError(f"a mini-batch of {len(rows)} responses does not split evenly over {world} ranks; make "
                         "rollout.prompts_per_step a multiple of trainer.mini_batches × trainer.ranks")  # fmt: skip
    size = len(rows) // world
    for cut in range(size, len(rows), size):
        if int(group_ids[rows[cut - 1]]) == int(group_ids[rows[cut]]):
            raise SplitError(f"rank boundary at row {rows[cut]} cuts a group of responses to one prompt; make "
                             "rollout.prompts_per_step a multiple of trainer.mini_batches × trainer.ranks")  # fmt: skip
    return rows[rank * size : (rank + 1) * size]


def rank_rows(group_ids: Tensor, mini_batches: int, rank: int, world: int) -> list[list[int]]:
    """Per mini-batch, the global row indices rank ``rank`` of ``world`` takes (see the module docstring)."""
    return [
        rank_share(rows, group_ids, rank, world) for rows in mini_batch_rows(len(group_ids), mini_batches)
    ]
