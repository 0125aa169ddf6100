"""Two ``fleet serve`` instances on one real PostgreSQL, block requests through an MQTT v5
shared subscription: two rollouts of different artifacts both end SUCCEEDED (whichever
instance a block request reaches serves it), and when the instance driving them is killed
with SIGKILL the other takes them over once its lease expires."""

import os
import subprocess
import sys
import time

from agent.fleet.database.store import Store
from tests.integration.postgres import postgres  # noqa: F401 - fixture
from tests.integration.test_fleet_rollout import digits_args, wait_status
from tests.integration.test_fleet_service import ROOT, fleet_cli, fp16_args, wait_registered


class Instance:
    """``fleet serve`` in a subprocess, its output in ``workdir/NAME.log``. ``options``: its
    own (default: the instance name ``name`` and a 2 s lease)."""

    def __init__(self, broker, db, store_dir, name, workdir, options=None):
        self.name = name
        self.args = [sys.executable, "-m", "agent", "fleet", "serve", "--broker", broker.url,
                     "--db", db, "--store", store_dir, "--share-group", "ctl"] + (
                         ["--instance", name, "--lease", "2"] if options is None
                         else list(options))
        self.log = os.path.join(str(workdir), name + ".log")
        self.proc = None
        self.env = {"PYTHONPATH": ROOT}  # its environment's own entries

    def start(self):
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen(self.args, stdout=logf, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **self.env), cwd=ROOT)
        logf.close()
        return self

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self):
        with open(self.log, "rb") as f:
            return f.read()[-3000:].decode("utf-8", "replace")


def test_two_instances_share_rollouts_and_take_over_from_a_killed_one(
        mosquitto, agent_factory, postgres, tmp_path):  # noqa: F811 - fixture
    db = postgres.url
    store_dir = str(tmp_path / "artifacts")
    agents = [agent_factory(n).start() for n in ("mc-a", "mc-b")]
    wait_status(mosquitto, ["mc-a", "mc-b"], agents=agents)
    one = Instance(mosquitto, db, store_dir, "one", tmp_path).start()
    two = Instance(mosquitto, db, store_dir, "two", tmp_path)
    try:
        wait_registered(db, ["mc-a", "mc-b"], one)
        two.start()
        for rid, model, dev in (("ro-m1", fp16_args(), "mc-a"),
                                ("ro-m2", digits_args(), "mc-b")):
            out = fleet_cli(["rollout"] + model + ["--devices", dev, "--rollout-id", rid,
                                                   "--db", db, "--store", store_dir,
                                                   "--submit", "--detach"])
            assert out.returncode == 0, out.stderr
        store = Store(db)
        try:
            deadline = time.monotonic() + 20
            while not (store.rollout("ro-m1") or {}).get("owner"):
                assert time.monotonic() < deadline, one.tail() + two.tail()
                time.sleep(0.1)
            owner = store.rollout("ro-m1")["owner"]
            (one if owner == "one" else two).kill()  # mid-rollout: the other carries on
            survivor = two if owner == "one" else one
            deadline = time.monotonic() + 120
            for rid in ("ro-m1", "ro-m2"):
                while store.rollout(rid)["state"] in ("running", "paused"):
                    assert survivor.proc.poll() is None, survivor.tail()
                    assert time.monotonic() < deadline, "{}: {}\n{}".format(
                        rid, store.rollout(rid), survivor.tail())
                    time.sleep(0.3)
                row = store.rollout(rid)
                assert row["state"] == "succeeded", (row, survivor.tail())
                assert row["counts"] == {"SUCCEEDED": 1}
        finally:
            store.close()
    finally:
        one.kill()
        two.kill()
