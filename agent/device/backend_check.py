"""At daemon start-up: can the worker's Python import the configured backend?

The worker (``worker_python``: on JetPack 4.6 the system Python 3.6, else the daemon's own)
does the imports, so that interpreter is asked, with ``find_spec`` (cheap: nothing is loaded;
a library that is present but fails to load still shows at the first job). The daemon warns
once with ``diag``'s fix and advertises no backend (``platform.backend`` null, the reason in
``platform.backend_problem``). Jobs still get the platform decision first (an unsupported
precision says so), then ``backend_unavailable`` with the fix rather than a host's hint. It
does not quietly run the onnxruntime emulation on a device meant for TensorRT: a rollout would
"succeed" there with CPU numbers.
"""

import logging
import os
import subprocess
import sys
from typing import List, Optional, Tuple

# backend -> (module, fix) pairs, the fixes being diag's.
FIX_TENSORRT = ("on a Jetson run scripts/install-jetson (its venv uses --system-site-packages so "
                "JetPack's python3-libnvinfer is visible); on a dGPU host: pip install tensorrt")
FIX_PYCUDA = "pip install pycuda (needs the CUDA toolkit: export PATH=/usr/local/cuda/bin:$PATH)"
FIX_ONNXRUNTIME = "pip install onnxruntime"
NEEDS = {
    "tensorrt": (("tensorrt", FIX_TENSORRT), ("pycuda", FIX_PYCUDA)),
    "onnxruntime": (("onnxruntime", FIX_ONNXRUNTIME),),
}
log = logging.getLogger("agent.device.daemon")
PROBE = ("import importlib.util, sys\n"
         "sys.stdout.write(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) "
         "is None))")


def missing_modules(modules: List[str], python: Optional[str] = None) -> Optional[List[str]]:
    """The modules ``python`` (default: this interpreter) cannot find; None when that
    interpreter does not run (the worker's own failure will say why, job by job)."""
    if not python or os.path.realpath(python) == os.path.realpath(sys.executable):
        import importlib.util

        out = []
        for name in modules:
            try:
                found = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                out.append(name)
        return out
    try:
        proc = subprocess.run([python, "-c", PROBE] + list(modules), capture_output=True,
                              timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("worker_python %s cannot be run to check the backend: %s", python, exc)
        return None
    if proc.returncode != 0:
        # The last line says why (a traceback's own lines would read as a daemon crash).
        lines = proc.stderr.decode("utf-8", "replace").strip().splitlines() or [""]
        log.warning("worker_python %s failed checking the backend (exit %s): %s", python,
                    proc.returncode, lines[-1][-300:])
        return None
    return proc.stdout.decode("utf-8", "replace").split()


def problem(backend: str, python: Optional[str] = None) -> Optional[str]:
    """One line naming what ``backend`` lacks in ``python`` and how to fix it, or None."""
    needs = NEEDS.get(backend, ())
    missing = missing_modules([m for m, _ in needs], python)
    if not missing:  # all there, or unknown (warned)
        return None
    fixes = "; ".join(fix for m, fix in needs if m in missing)
    return "backend {} is not usable: {} cannot import {} (fix: {})".format(
        backend, python or sys.executable, ", ".join(missing), fixes)


def choose(configured: str, platform_backend: str, python: Optional[str] = None
           ) -> Tuple[str, Optional[str]]:
    """(the backend jobs are built with, the problem to warn about once, or None).
    ``configured`` "auto" means the platform's backend."""
    backend = platform_backend if configured == "auto" else configured
    return backend, problem(backend, python)
