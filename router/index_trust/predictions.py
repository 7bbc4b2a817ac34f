"""Prediction checks, per request: what the router predicted a replica would reuse, what it
reused, and why the two differ.

At decision time the router records, for the replica it sends a request to, the fleet's
best cached depth, the depth the index showed for that replica, the depth the speculative
entries added, and the replica's incarnation. The replica answers (``Complete``) with what
it reused and what it knows: its own hash of the first block, how long ago the first
missing block was evicted, how long its unpredicted hits had been hittable. A miss is then
put down to one cause:

- ``replica_restarted``: another incarnation served it than the one the index described;
- ``hash_mismatch``: the replica hashes blocks differently (the index can never be right);
- ``speculative_unrealized``: only the speculative part of the prediction failed;
- ``evicted``: the first missing block was evicted lately (between lookup and arrival);
- ``stale_index``: the index claimed blocks the replica never evicted, or lacked blocks the
  replica had held for longer than events take to arrive (lost or unapplied events);
- ``index_lag``: the replica's unpredicted hits were younger than that (normal: events in
  flight, or another router's requests).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.protos import pb

CAUSES = (
    "replica_restarted",
    "hash_mismatch",
    "speculative_unrealized",
    "evicted",
    "stale_index",
    "index_lag",
)
LIES = frozenset({"stale_index", "hash_mismatch"})  # causes that say the index is wrong, not late


@dataclass(frozen=True)
class Prediction:
    """What the router expected of the replica it chose, at decision time (in blocks)."""

    replica_id: str
    incarnation: int
    fleet_best: int  # the deepest cached prefix any replica had, in either tier
    index: int  # what the index showed for this replica in its device tier
    speculative: int  # what this router's speculative entries showed for it
    predicted: int  # blocks it will reuse: the two's max, or its host tier's continuation of it
    host: int = 0  # of ``predicted``, the blocks the index showed only in its host tier

    def error(self, complete: pb.Complete, block_size: int) -> int:
        """Predicted minus reused blocks (> 0: the index promised more than was there)."""
        return self.predicted - complete.usage.cached_tokens // block_size


def miss_cause(
    prediction: Prediction, complete: pb.Complete, block_size: int, lag_tolerance_s: float
) -> str | None:
    """The cause of a prediction that missed, None when it was exact."""
    if complete.incarnation and complete.incarnation != prediction.incarnation:
        return "replica_restarted"
    if complete.hash_mismatch:
        return "hash_mismatch"
    actual = complete.usage.cached_tokens // block_size
    if actual == prediction.predicted:
        return None
    if actual < prediction.predicted:
        if prediction.speculative > prediction.index and actual >= prediction.index:
            return "speculative_unrealized"
        if (
            complete.HasField("miss_evicted_age_ms")
            and complete.miss_evicted_age_ms <= lag_tolerance_s * 1000
        ):
            return "evicted"
        return "stale_index"
    if complete.HasField("unindexed_hit_age_ms") and complete.unindexed_hit_age_ms > lag_tolerance_s * 1000:
        return "stale_index"
    return "index_lag"
