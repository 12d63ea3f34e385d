"""Which rows of a batch each rank scores and backpropagates, and the one rule that makes the split possible.

The optimizer walks mini-batches of consecutive rows (``train/step.py``); rank r takes the r-th of N equal,
contiguous slices of every mini-batch, so rank r's k-th local mini-batch is its share of the global k-th one
and the N ranks together take exactly the optimizer steps one process takes. A slice boundary never falls
inside a group (the responses to one prompt), so group baselines are those of one process:

    global rows  | g0 g0 g1 g1 | g2 g2 g3 g3 |     (mini_batches = 2, 2 rows per group)
    rank 0       | g0 g0       | g2 g2       |
    rank 1       |       g1 g1 |       g3 g3 |

``split_problem`` is the rule, read by the config check (``train.config.validate``, before any model loads) and
by ``rank_share`` on each batch. A group of one process (N = 1) takes every row.
"""

from __future__ import annotations

from torch import Tensor


class SplitError(ValueError):
    """The batch cannot be split into equal per-rank shares of whole groups."""


def split_problem(groups: int, mini_batches: int, ranks: int) -> tuple[str, str] | None:
    """Why ``groups`` prompts' groups of responses cannot be cut into ``mini_batches`` mini-batches of whole
    groups, each shared by ``ranks`` ranks in equal numbers of whole groups: (the config key to change, the
    reason); None when they can, i.e. when ``groups`` is a multiple of ``mini_batches`` × ``ranks``."""
    if groups % mini_batches:
        return "trainer.mini_batches", (f"{groups} prompts' groups do not split into {mini_batches} mini-batches of "
                                        "whole groups: rollout.prompts_per_step must be a multiple of "
                                        "trainer.mini_batches")
    if groups % (mini_batches * ranks):
        return "trainer.ranks", (f"{groups // mini_batches} prompts' groups per mini-batch do not split evenly over "
                                 f"{ranks} ranks (each rank takes whole groups of every mini-batch): "
                                 "rollout.prompts_per_step must be a multiple of trainer.mini_batches × "
                                 "trainer.ranks")
    return None


def rank_share(rows: list[int], group_ids: Tensor, rank: int, world: int) -> list[int]:
    """Rank ``rank``'s contiguous 1/``world`` of a mini-batch's ``rows``; a ``SplitError`` if a cut would fall
    inside a group (groups of unequal sizes)."""
    size = len(rows) // world
    cuts = range(size, len(rows), size) if size else []
    if len(rows) % world or any(int(group_ids[rows[cut - 1]]) == int(group_ids[rows[cut]]) for cut in cuts):
        raise SplitError(f"a mini-batch of {len(rows)} responses cannot be cut into {world} equal shares of whole "
                         "groups (the groups of responses to one prompt differ in size)")
    return rows[rank * size : (rank + 1) * size]


def rank_rows(mini_batches: list[list[int]], group_ids: Tensor, rank: int, world: int) -> list[list[int]]:
    """Per mini-batch (its global rows, consecutive), the global row indices rank ``rank`` of ``world`` takes;
    a ``SplitError`` naming the config keys when a mini-batch's groups cannot be shared (``split_problem``)."""
    for rows in mini_batches:  # whole groups per rank (the mini-batches themselves are the step's)
        problem = split_problem(len({int(g) for g in group_ids[rows].tolist()}), 1, world)
        if problem is not None:
            raise SplitError(problem[1])
    return [rank_share(rows, group_ids, rank, world) for rows in mini_batches]
