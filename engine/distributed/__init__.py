"""Tensor parallelism: the rank processes rank 0 starts and watches, and each rank's shard of the
weights, read slice by slice from safetensors, with an all-reduce after its row-parallel layers."""
from engine.distributed.ranks import RankGroup, join_as_rank, rank_device
from engine.distributed.tensor_parallel import add_all_reduce, check_shardable, load_shard

__all__ = ["RankGroup", "join_as_rank", "rank_device", "load_shard", "check_shardable", "add_all_reduce"]
