"""How far the router trusts the index: each prediction checked against what the replica
reused (predictions), the per-replica trust states (states), and the watch that ties them to
the registry, resyncs and metrics (watch)."""
