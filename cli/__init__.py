"""kvmesh.cli: the ``kvmesh`` command line: its table of commands (``commands/``, one module
each), the flags derived from the config dataclasses, structured logging, and the bodies of
the commands that are only a command (``status``, ``download-model``).

It may import every other part; nothing imports it (``tests/test_layering.py``).
"""
