"""The config leaf: typed config fields (`fields`) and the environment knobs (`environment`).

A package of its own, below `trainer`, `parallelisms`, `models` and `planner`, and importing
only the standard library, so that any of them may use it without importing another.
"""
