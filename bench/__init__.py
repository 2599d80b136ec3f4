"""``eplb-bench`` (``report``) and the developer benchmarks, each runnable as
``python -m eplb_bench.<name>``; what they share is in ``eplb_bench.harness`` (installed as
``eplb_bench``)."""
