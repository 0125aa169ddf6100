"""One logging setup for the CLI, the daemon and the worker.

When stderr is the journal (``$JOURNAL_STREAM`` names stderr's device and inode, as systemd
sets it for a service), each line starts with its syslog priority, ``<4>`` for a warning
(sd-daemon(3)), so ``journalctl -u jetson-agent -p warning`` shows the warnings and errors;
journald adds timestamps, so we leave them out. A process whose stderr goes elsewhere (the
worker's log file, a terminal) keeps the plain format even though it inherited the variable.
"""

import logging
import os
import sys
from typing import IO, Any, Optional

# logging level -> syslog priority (sd-daemon.h: SD_DEBUG 7 ... SD_CRIT 2).
PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
              (logging.INFO, 6))


def priority(levelno: int) -> int:
    for level, prio in PRIORITIES:
        if levelno >= level:
            return prio
    return 7


def stderr_is_journal(stream: Optional[IO[Any]] = None) -> bool:
    """True when ``stream`` (default stderr) is the journal stream systemd connected."""
    value = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


class JournalFormatter(logging.Formatter):
    """``<N>`` syslog priority prefix on every line of a record (tracebacks included)."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = "<{}>".format(priority(record.levelno))
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def setup_logging(verbose: int = 0) -> None:
    level = logging.WARNING - 10 * verbose
    handler = logging.StreamHandler(sys.stderr)
    if stderr_is_journal():
        handler.setFormatter(JournalFormatter("%(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=max(level, logging.DEBUG), handlers=[handler])
