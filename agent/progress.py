"""Progress for long work: a bar on a terminal, plain lines otherwise (never on stdout, so
``--json`` output stays clean).

Each bar is labelled with its stage. A stage that starts over after finishing (TensorRT's
entropy calibration reads the data twice: ranges, then histograms) gets "(pass 2)" in its
label, and a repeated "finished" report draws nothing, so one pass is one bar.
"""

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
        self._done = 0
        self._finished = False
        self._pass = 1

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        finished = bool(total and done >= total)
        new_stage = stage != self._stage
        if new_stage:
            self._pass = 1
        elif self._finished:
            if finished:
                return  # the same pass reported finished again: its bar is drawn
            self._pass += 1  # the stage starts over: a new, numbered bar
            new_stage = True
        elif done < self._done:
            self._pass += 1
            new_stage = True
        if not new_stage and not finished and now - self._last < self.min_interval:
            return
        self._last, self._stage, self._done, self._finished = now, stage, done, finished
        label = stage if self._pass == 1 else "{} (pass {})".format(stage, self._pass)
        if self.tty:
            if total:
                width = 30
                fill = int(width * min(done, total) / total)
                line = "\r{:<12} [{}{}] {}/{}".format(
                    label, "#" * fill, "." * (width - fill), done, total)
            else:
                line = "\r{:<12} {}".format(label, done)
            self.stream.write(line + ("\n" if finished else ""))
        elif new_stage or finished:
            self.stream.write("{}: {}/{}\n".format(label, done, total or "?"))
        self.stream.flush()
