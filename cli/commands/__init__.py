"""One module per ``kvmesh`` command: each ``register``s its parser and the handler it runs."""
