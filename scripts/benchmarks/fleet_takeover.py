"""Takeover between ``fleet serve`` instances (agent.fleet.database.leases, docs/fleet.md "Several
instances"): the seconds from a fault of the instance driving a rollout until the other
instance holds it, under the default lease (6 s), on SQLite and PostgreSQL; and the seconds
from a kill -9 until a restart under the same (default) name holds its rollout again.

Runs tests/integration/test_fleet_takeover.py and test_fleet_fencing.py (real Mosquitto, real
PostgreSQL, real agents and simulated devices) REPEAT times (default 3), which write their
timings to a file (``TAKEOVER_TIMINGS``); each kind becomes a row with the median and the worst
of its runs:

- ``sigstop``: the owner stopped (SIGSTOP) mid-stream; resumed after the takeover it publishes,
  deletes and serves nothing (the test asserts it);
- ``kill9``: the owner killed (SIGKILL);
- ``restart``: ten kill -9s in a row, each followed by a restart (lease 60 s there: waiting
  it out would show).

    python scripts/lib/bench.py fleet_takeover        (FLEET_TAKEOVER_REPEAT=1)
"""

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPEAT = int(os.environ.get("FLEET_TAKEOVER_REPEAT", "3"))
GOALS = {"sigstop": "<= 10 s", "kill9": "<= 10 s", "restart": "< 1 lease (6 s)"}


def measure(repeat=REPEAT):
    """kind label -> seconds measured, over ``repeat`` runs of the test file."""
    fd, path = tempfile.mkstemp(prefix="takeover-", suffix=".txt")
    os.close(fd)
    try:
        for _ in range(repeat):
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"] +
                [os.path.join(ROOT, "tests", "integration", name)
                 for name in ("test_fleet_takeover.py", "test_fleet_fencing.py")],
                cwd=ROOT, capture_output=True, text=True,
                env=dict(os.environ, TAKEOVER_TIMINGS=path,
                         PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
            if proc.returncode != 0:
                raise RuntimeError("the takeover tests failed:\n" + proc.stdout[-4000:])
        out = {}
        with open(path) as f:
            for line in f:
                label, seconds = line.split()
                out.setdefault(label, []).append(float(seconds))
        return out
    finally:
        os.unlink(path)


def run():
    rows = []
    for label, values in sorted(measure().items()):
        kind = label.split("_")[0]
        values = sorted(values)
        for stat, value in (("median", values[len(values) // 2]), ("worst", values[-1])):
            rows.append({"name": "{} ({} of {})".format(label, stat, len(values)), "ours": value,
                         "baseline": None, "unit": "s", "goal": GOALS.get(kind, "-")})
    return rows


if __name__ == "__main__":
    for row in run():
        print("{name}: {ours:.2f} {unit} (goal {goal})".format(**row))
