"""Model families kvmesh can serve, and their loader."""
