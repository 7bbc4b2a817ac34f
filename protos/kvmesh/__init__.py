"""Generated code for the kvmesh.v1 protos (see protos/generate.py)."""
