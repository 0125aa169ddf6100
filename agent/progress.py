"""Progress for long work: a bar on a terminal, plain lines otherwise (never on stdout, so
``--json`` output stays clean)."""

import sys
import time
from typing import IO, Optional


class ProgressBar(object):
    """Callable as ``progress(stage, done, total)`` (see backends.base.Progress)."""

    def __init__(
        self,
        stream: Optional[IO[str]] = None,
        enabled: bool = True,
        min_interval: float = 0.1,
    ) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.min_interval = min_interval
        self._last = 0.0
        self._stage = ""

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        finished = total and done >= total
        if stage == self._stage and not finished and now - self._last < self.min_interval:
            return
        new_stage = stage != self._stage
        self._last, self._stage = now, stage
        if self.tty:
            if total:
                width = 30
                fill = int(width * min(done, total) / total)
                line = "\r{:<12} [{}{}] {}/{}".format(
                    stage, "#" * fill, "." * (width - fill), done, total)
            else:
                line = "\r{:<12} {}".format(stage, done)
            self.stream.write(line + ("\n" if finished else ""))
        elif new_stage or finished:
            self.stream.write("{}: {}/{}\n".format(stage, done, total or "?"))
        self.stream.flush()
