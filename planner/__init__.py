"""The layout planner: which layout fits, how fast it runs, and the config that runs it.

Modules by concern: `hardware` (GPU table, TOML entries, the calibrated CPU), `workload`
(FLOPs and widths read from the built model), `layout` (`Plan`), `memory` (the exact
estimator in trainer/memory/, cached per local shape), `step_time` (the time model),
`search` (enumeration, validators, branch and bound), `report` (table, explain, --write),
`calibrate` (--calibrate), `cli`. docs/planner.md explains the model and its numbers.
"""
