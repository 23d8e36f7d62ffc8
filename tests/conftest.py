import os

# Tests run many ranks on 2 cores: one intra-op thread per process keeps them from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
