"""Fault tolerance: a run that keeps going when part of it fails, and says which part when it cannot.

- `replicas.py`: torchft replica groups; the one object (`ReplicaGroups`) that owns the quorum,
  the cross-group sums, should-commit and healing from a live peer (docs/fault_tolerance.md).
- `heal_state.py`: what a healing group copies from a live one.
- `lighthouse.py`: torchft's lighthouse server, started for a one-machine run, and its reachability check.
- `config.py`: the `[fault_tolerance]` section.
- `hang.py`: a rank that stops responding is named in one line, every rank's stack on disk (any run).
"""
