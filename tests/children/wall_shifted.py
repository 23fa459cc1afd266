"""``OFFSET_S ARGS...``: ``python -m shmhb ARGS...`` with the
process's wall clock (``time.time``, ``time.time_ns``) shifted by OFFSET_S seconds."""

import runpy, sys, time
off_ns = int(float(sys.argv[1]) * 1e9)
real_ns, real = time.time_ns, time.time
time.time_ns = lambda: real_ns() + off_ns
time.time = lambda: real() + off_ns / 1e9
sys.argv = ["shmhb", *sys.argv[2:]]
runpy.run_module("shmhb", run_name="__main__", alter_sys=True)
