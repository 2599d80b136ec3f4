import os

from hypothesis import settings

# CI machines have 2 cores; keep property tests bounded and free of deadline flakiness.
settings.register_profile("ci", max_examples=60, deadline=None)
settings.register_profile("dev", max_examples=30, deadline=None)
# Bug hunting before a commit: HYPOTHESIS_PROFILE=thorough pytest tests/planner/test_packing.py ...
settings.register_profile("thorough", max_examples=1500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
