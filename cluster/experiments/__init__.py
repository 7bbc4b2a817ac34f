"""Prefix-aware load-balancing experiments: workloads, load generator, reports, simulator."""
