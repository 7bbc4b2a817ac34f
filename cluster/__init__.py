"""kvmesh.cluster: the ``kvmesh`` CLI, launchers and experiments."""
