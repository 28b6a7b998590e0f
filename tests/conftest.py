import os

# Keep every test process single-threaded per rank; CI has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# A rank that dies in native code (SIGABRT, SIGSEGV) prints every thread's Python stack, so a
# CI log shows where it was.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# The planner's lines in every --dry-run (trainer/preflight.py) run the memory estimator; only
# tests/test_planner.py turns them on.
os.environ.setdefault("TITAN_DRY_RUN_PLAN", "0")
