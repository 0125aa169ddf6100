"""The worker: one job in its own process, so a crash or a kill never takes the daemon down.

    python -m agent.worker --job JOBFILE --state-dir DIR

Reads the job spec (``agent.worker.jobs.make_spec``) and streams JSON lines on stdout:

    {"type": "progress", "stage": "calibrating", "done": 3, "of": 10}
    {"type": "result", "result": {...}}                      exit status 0
    {"type": "error", "error": {"code": ..., "message": ...}}  exit status 2 (3: internal error)

Anything else the process prints (libraries, logging) goes to stderr: file descriptor 1 is
pointed at stderr at start and the protocol uses a private copy of the original stdout.
SIGTERM asks the job to stop (a search returns what it has); a second SIGTERM exits at once.
Worker side: Python >= 3.6 (JetPack 4.6's system Python runs it).

Package: this module (the process entry; ``__main__`` runs ``main``; an exhausted memory named
as ``out_of_memory``), ``jobs`` (deploy, search and bench inside the worker), ``context`` (what
every kind of job works with) and ``accuracy`` (the gate). Python 3.6 like everything it
imports. May import ``engines``, ``precision``, ``platform``, ``calib`` and the base modules;
never ``device``, ``fleet``, ``wire`` or ``cli`` (tests/unit/test_import_rules.py).
"""

import argparse
import json
import logging
import math
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any, Dict, List, Optional

if TYPE_CHECKING:
    from agent.errors import AgentError

EXIT_OK, EXIT_ERROR, EXIT_INTERNAL = 0, 2, 3
# One protocol line, well under what the daemon reads as one line (4 MiB): a longer error keeps
# its code with a cut message and no details, so it is never mistaken for a crash.
MAX_LINE_BYTES = 1 << 20


def _plain(value: Any) -> Any:
    """JSON-safe: numpy scalars/arrays to Python, non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "tolist"):  # numpy scalar or array
        return _plain(value.tolist())
    return value


class Channel(object):
    """The protocol stream: a private duplicate of stdout, one JSON object per line."""

    def __init__(self) -> None:
        sys.stdout.flush()
        fd = os.dup(1)
        os.dup2(2, 1)  # stray prints (C libraries included) land in stderr
        self._out = os.fdopen(fd, "w", buffering=1)
        sys.stdout = sys.stderr

    def emit(self, message: Dict[str, Any]) -> None:
        self._out.write(fit_line(message) + "\n")
        self._out.flush()


def fit_line(message: Dict[str, Any]) -> str:
    """The JSON line of a protocol message within MAX_LINE_BYTES: an oversized error keeps its
    code; any other oversized message becomes an ``internal_error`` that says so."""
    line = json.dumps(_plain(message), sort_keys=True, allow_nan=False)
    if len(line) <= MAX_LINE_BYTES:
        return line
    error = message.get("error") if message.get("type") == "error" else None
    if isinstance(error, dict) and error.get("code"):
        text = str(error.get("message", ""))
        cut = {"code": error["code"], "message": text[:8192] + (
            " ... ({:,} characters cut)".format(len(text) - 8192) if len(text) > 8192 else ""),
            "details": {"cut": "the details were {:,} bytes".format(len(line))}}
    else:
        cut = {"code": "internal_error", "message": "the worker's {} message was {:,} bytes, "
               "over the protocol line limit of {:,}".format(message.get("type"), len(line),
                                                             MAX_LINE_BYTES)}
    return json.dumps({"type": "error", "error": cut}, sort_keys=True)


class StopFlag(object):
    def __init__(self) -> None:
        self.requested = False

    def __call__(self) -> bool:
        return self.requested

    def install(self) -> None:
        def on_signal(signum: int, frame: Any) -> None:
            if self.requested:
                os._exit(128 + signum)
            self.requested = True
            logging.getLogger("agent.worker").info("stop requested (signal %d)", signum)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)


def out_of_memory(exc: BaseException) -> "AgentError":
    """The error of a worker that hit its memory ceiling (RLIMIT_DATA set by the daemon)."""
    import resource

    from agent.errors import AgentError

    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    named = ("its limit of {:,} bytes (limits.worker_memory_bytes)".format(limit)
             if limit != resource.RLIM_INFINITY else "the memory of this device")
    return AgentError("out_of_memory", "the worker ran out of memory: the job needs more than "
                      "{} ({}: {})".format(named, type(exc).__name__, str(exc)[:200]),
                      {"limit_bytes": None if limit == resource.RLIM_INFINITY else limit})


def is_memory_failure(exc: BaseException) -> bool:
    """A native library's allocation failure (onnxruntime, TensorRT) seen as an exception."""
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or any(
        marker in text for marker in ("bad_alloc", "bad allocation", "failed to allocate",
                                      "out of memory", "cannot allocate memory"))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.worker",
                                     description="Run one jetson-agent job (started by the "
                                                 "daemon).")
    parser.add_argument("--job", required=True, help="job spec (JSON) written by the daemon")
    parser.add_argument("--state-dir", required=True, help="the daemon's state directory")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    args = parser.parse_args(argv)
    os.environ["JETSON_AGENT_STATE_DIR"] = args.state_dir
    logging.basicConfig(level=max(logging.DEBUG, logging.INFO - 10 * args.verbose),
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    channel = Channel()
    stop = StopFlag()
    stop.install()

    from agent.errors import AgentError

    try:
        with open(args.job) as f:
            spec = json.load(f)
        from agent.worker.jobs import run_job

        result = run_job(spec, channel.emit, stop)
        channel.emit({"type": "result", "result": result})
        return EXIT_OK
    except AgentError as exc:
        channel.emit({"type": "error", "error": exc.to_dict()})
        return EXIT_ERROR
    except MemoryError as exc:
        channel.emit({"type": "error", "error": out_of_memory(exc).to_dict()})
        return EXIT_ERROR
    except Exception as exc:  # noqa: BLE001 - reported to the daemon, never hidden
        traceback.print_exc()
        if is_memory_failure(exc):  # a native library's allocation failure
            channel.emit({"type": "error", "error": out_of_memory(exc).to_dict()})
            return EXIT_ERROR
        channel.emit({"type": "error", "error": {
            "code": "internal_error",
            "message": "{}: {}".format(type(exc).__name__, exc)}})
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
