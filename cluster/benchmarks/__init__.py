"""Benchmarks behind ``kvmesh bench``: each writes JSON and compares against a same-run baseline."""
