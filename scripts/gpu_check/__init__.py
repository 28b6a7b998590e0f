"""The prepared GPU check, driven by scripts/gpu_check.sh (`python -m gpu_check`).

Why it is built this way: a GPU is lent for about ten minutes, once, in one command, so the
check must bring back a complete, honest table however the run ends.

- `plan`: the sections, cheap ones first, each with a time budget built from named cold-start
  costs; the core budgets sit at least 70 s under the 470 s deadline, a section may use what
  earlier ones left unused, and the deadline skips what no longer fits.
- `driver`: runs each section in its own process group under its timeout (a hang or a cold
  compile that runs long becomes a row, not a stuck job) and rewrites the table after each.
- `rows` / `report`: each section writes its rows to `<out>/rows/<section>.json` as it goes
  (a row in progress says which phase it is in, so a row cut off mid-compile is marked, not
  counted); `report` turns the folder into `<out>/gpu_check.md`, with `numbers` holding each
  trainer row's losses and gradient norms against its reference row (MISMATCH beyond tolerance).
- `env`, `bench`, `attention`, `kernels`, `dist_checks`: the sections themselves (they import
  torch; the driver, plan, numbers and report do not, so a broken torch still yields a table
  that says so).

`--dry` runs every section on CPU with tiny shapes (tests/test_gpu_check.py), so the script
works the first time a GPU appears.
"""
