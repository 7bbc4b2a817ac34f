"""kvmesh.bench: measuring. One module per ``kvmesh bench`` subcommand, named after it
(``engine.py`` is ``kvmesh bench engine``), their helpers, the demo, the experiment suite and
the simulator (``experiments/``), and the measuring kit every one of them shares
(``measure/``: workloads, load generator, reports, percentiles).

It may import the serving parts and ``cluster`` (to start deployments); it must not import
``cli``. Inside it, ``measure`` imports nothing else of ``bench``, and ``experiments`` only
``measure`` (``tests/test_layering.py``).
"""
