"""The package's parts: its top-level folders, each installed as ``kvmesh.<part>``, in import
order (docs/design.md#layout). The layering, style and packaging tests walk the same list."""

PARTS = ["kvcache", "protos", "serving", "router", "engine", "replica", "cluster", "bench", "cli"]
