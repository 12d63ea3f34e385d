"""Data-parallel learning on torch.distributed (docs/distributed.md).

    ranks.py    ``Ranks``: a rank's view of the group and its collectives; itself the group of one process
    group.py    ``ProcessGroup``: torchrun's processes (gloo / NCCL); ``join``: this process's ranks
    shard.py    the learner sharded with FSDP2 (per decoder layer + a scoring root)
    split.py    which rows each rank takes (whole groups, an equal share of every mini-batch)
    roles.py    rank 0 leads (executor, evaluator, files), the others follow
    checkpoint.py  a sharded learner's checkpoints (DCP), extending ``rollcorr.checkpoint``
    launch.py   ``rollcorr train trainer.ranks=N``: N processes through ``torch.distributed.run``

A ``DTensor``'s local shard is read through ``rollcorr.shards`` (math: the π_old strategies use it too).

A run started without torchrun is the group of one process (``ONE_PROCESS``): its collectives return their
input, and nothing is sharded.
"""

from rollcorr.distributed.group import ProcessGroup, close, init_from_env, join, launched
from rollcorr.distributed.ranks import ONE_PROCESS, DistributedError, Ranks
from rollcorr.distributed.split import SplitError, rank_rows

__all__ = ["ONE_PROCESS", "DistributedError", "ProcessGroup", "Ranks", "SplitError", "close", "init_from_env",
           "join", "launched", "rank_rows"]
