"""Shared test setup: never touch the network, keep torch to the machine's 2 cores."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Tests run tiny tensor ops: one thread is faster than two (no OpenMP hand-off), and never oversubscribes
# the 2-core CI machine when a test spawns subprocesses.
os.environ.setdefault("OMP_NUM_THREADS", "1")
