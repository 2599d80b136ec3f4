"""What the benchmarks share, so that no benchmark script imports another.

- ``processes``: ``eplb serve`` replicas and a private Redis as child processes (``free_port``);
- ``redis_cluster``: a private 3-master Redis Cluster;
- ``trees``: two trees of ``eplb`` timed against each other (``--baseline``).

The modules import only ``eplb``, the other installed packages and each other (never a
benchmark script); ``tests/test_layout_imports.py`` checks it.
"""
