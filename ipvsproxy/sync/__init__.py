"""The sync core: desired state, ownership, planning, plan rendering (pure functions and
values), the tracker of changed objects, and the runner that decides when a pass runs (its
one thread-aware piece: sync/runner.py)."""
