"""One logging setup for the CLI, the daemon and the worker.

Under systemd (JOURNAL_STREAM is set) journald adds timestamps, so we leave them out.
"""

import logging
import os
import sys


def setup_logging(verbose: int = 0) -> None:
    level = logging.WARNING - 10 * verbose
    if os.environ.get("JOURNAL_STREAM"):
        fmt = "%(levelname)s %(name)s: %(message)s"
    else:
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=max(level, logging.DEBUG), format=fmt, stream=sys.stderr)
