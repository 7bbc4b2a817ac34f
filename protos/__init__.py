"""kvmesh.protos: the kvmesh.v1 wire contract and its generated Python stubs."""
