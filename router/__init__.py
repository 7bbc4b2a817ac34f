"""kvmesh.router: the gRPC front door, routing policies and prefix-index client."""
