"""kvmesh.router: routing only: the decision (policies, load accounting), the registry of live
replicas, speculative entries, the relay with failover, the ``kvmesh.v1.Router`` service and
its process. Never imports kvmesh.replica, torch or Ray."""
