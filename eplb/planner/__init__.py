"""The planner of ``global``, ``hierarchical`` and ``auto``: from expert loads to a placement.

- ``replicate``: replica counts by water-filling (``waterfill``, ``replica_cap``);
- ``packing``: replicas onto gpus (``pack``), and slot swaps and rotations with counts fixed;
- ``counts``: count moves, one replica moved from a donor expert to a hot one;
- ``hot``: the few hottest experts' counts chosen together so no gpu holds two of them;
- ``pairing``: counts built for a target busiest gpu at two slots per gpu;
- ``excess``: at two slots per gpu, counts searched by their excess over a target busiest gpu;
- ``borrow``: replica counts borrowed across the rows of one search chunk, by load rank;
- ``search``: the anytime search after the first plan (it runs ``pairing`` and ``excess``);
- ``spread``: hot experts' replicas spread over nodes (``rebalance(spread_nodes=True)``);
- ``anytime``: the planner that runs them (``plan_placement``, ``PlanOptions``).

Each step works on the ``[rows, bins, slots]`` layout of ``eplb.layout``. Re-planning from a
previous placement is ``eplb.replan``'s; bounds are ``eplb.bounds``'s.
"""
