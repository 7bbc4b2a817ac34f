"""kvmesh.v1 stubs: do not edit, run make protos."""
