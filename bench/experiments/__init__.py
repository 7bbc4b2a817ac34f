"""The experiment suite (``kvmesh experiments``), the discrete-event simulator (``kvmesh
simulate``) and its cost models: prefix-aware load balancing studied with the real ledger
and policies. Imports ``measure`` and nothing else of ``bench``."""
