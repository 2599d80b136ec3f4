"""What the benchmarks share, so that no benchmark script imports another.

- ``processes``: ``eplb serve`` instances and a private Redis as child processes;
- ``redis_cluster``: a private 3-master Redis Cluster;
- ``trees``: two trees of ``eplb`` timed against each other (``--baseline``);
- ``cases``: ``default_bench``'s target table and the ``--cases``/``--list`` choice;
- ``shapes``: routing-count loads shaped like real traces;
- ``optimum``: the CP-SAT bracket of the best counts at two slots per gpu;
- ``floors``: lower bounds on a re-plan's moves with the replica counts kept;
- ``service``: the service benchmarks' deployment and latency client;
- ``mover``: expert weights that name their expert, for the weight-mover benchmarks.

The modules import only ``eplb``, the other installed packages and each other (never a
benchmark script); ``tests/test_layout_imports.py`` checks it.
"""
