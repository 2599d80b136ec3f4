"""The tools a user runs: the ``eplb`` command (``place``, ``serve``, ``demo``, ``ctl``), the trace
and placement file formats (``io``), plots, and the demo (installed as ``eplb_tools``)."""
