"""``python _cprofile_cpu.py OUT -m agent ARGS...``: the main thread of ``python -m agent ARGS``
under cProfile, timed by that thread's CPU time (not wall time: on a shared, loaded host a
wall-clock profile charges the waits for a core to whatever was running)."""

import cProfile
import runpy
import sys
import time

if __name__ == "__main__":
    out, module = sys.argv[1], sys.argv[3]
    sys.argv = [module] + sys.argv[4:]
    prof = cProfile.Profile(time.thread_time)
    try:
        prof.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    finally:
        prof.dump_stats(out)
