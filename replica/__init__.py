"""kvmesh.replica: the per-accelerator engine, its gRPC service and Ray actor."""
