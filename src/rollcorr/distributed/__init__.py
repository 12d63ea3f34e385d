"""Data-parallel learning on torch.distributed (docs/distributed.md).

    group.py   the process group from torchrun's environment (gloo / NCCL), ``Ranks`` and its collectives
    shard.py   the learner sharded with FSDP2 (per decoder layer + a scoring root)
    split.py   which rows each rank takes (whole groups, an equal share of every mini-batch)
    launch.py  ``rollcorr train trainer.ranks=N``: N processes through ``torch.distributed.run``

A one-process run starts no process group and shards nothing (it reads ``shard.local_tensor`` only).
"""

from rollcorr.distributed.group import DistributedError, Ranks, close, init_from_env, launched
from rollcorr.distributed.split import SplitError, rank_rows

__all__ = ["DistributedError", "Ranks", "SplitError", "close", "init_from_env", "launched", "rank_rows"]
