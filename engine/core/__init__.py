"""Which rows the next forward pass computes, and which KV blocks hold them: requests as Sequences,
the scheduler, the block pool and each batch's figures. Pure logic: no torch."""
from engine.core.block_pool import BlockPool, chain_hashes, hash_salt
from engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, batched_tokens
from engine.core.sequence import Sequence, Status
from engine.core.stats import StatsCollector

__all__ = ["Sequence", "Status", "Scheduler", "SchedulerOutput", "ScheduledChunk", "batched_tokens",
           "BlockPool", "chain_hashes", "hash_salt", "StatsCollector"]
