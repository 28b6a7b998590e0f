import os

# Keep every test process single-threaded per rank; CI has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
