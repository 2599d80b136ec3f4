"""eplb's tools: the ``eplb`` command line and ``eplb-bench`` reports (installed as ``eplb_bench``)."""
