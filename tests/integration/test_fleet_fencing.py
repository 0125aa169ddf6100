"""Fencing that holds on resume (agent.fleet.database.leases, agent.wire.send_gate), on real
SQLite and PostgreSQL, a real Mosquitto logging every PUBLISH and its sender, and 2,000
simulated devices fetching their artifact block by block (scripts/simulate_devices.py).

The holder of a streaming rollout is stopped (SIGSTOP) with messages queued in its MQTT
client, block requests and statuses on their way to it, and outbox rows awaiting deletion;
the other instance takes the rollout over. The devices are then held still (no new requests),
the stopped one resumed (SIGCONT) and watched until it says it acts on its own account again:
in that time it published nothing (the broker's log, by its client id), deleted no outbox row
(as its own database connection reports it: ``outbox_probe``) and so answered no block
request; afterwards it never publishes on the rollout's job topics, and the new holder
finishes the rollout. The counts are printed (docs/benchmarks.md records them).

The holder is stopped outside a transaction of its own: stopped inside one (milliseconds
long) it would hold the SQLite write lock or the PostgreSQL row lock of its rollout, and the
takeover would wait for it to resume (docs/reliability.md).
"""

import os
import re
import signal
import sqlite3
import sys
import time

import pytest

from agent.fleet.database.db import Db, sqlite_path
from agent.fleet.database.store import Store
from tests.integration.postgres import postgres  # noqa: F401 - fixture
from tests.integration.test_fleet_service import ROOT, fleet_cli, fp16_args
from tests.integration.test_fleet_takeover import (  # noqa: F401 - fixtures
    TAKEOVER_BOUND_S,
    Instance,
    db_kind,
    heartbeat,
    lease,
    mosquitto,
    publishes,
    record,
    url_of,
    wait_heartbeat,
    wait_lease,
)

sys.path.insert(0, os.path.join(ROOT, "scripts"))

from simulate_devices import SimulatedFleet  # noqa: E402

COUNT = 2000
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "outbox_probe")


class Probed(Instance):
    """An instance whose outbox deletes are counted (``deleted``), its database sessions
    named ``label`` (PostgreSQL: pg_stat_activity.application_name)."""

    def __init__(self, broker, db, workdir, label):
        if db.startswith("postgresql"):
            db += ("&" if "?" in db else "?") + "application_name=" + label
        Instance.__init__(self, broker, db, workdir, label, ["--admission", "open"])
        self.probe = os.path.join(str(workdir), label + ".deletes")
        self.env = {"PYTHONPATH": PROBE + os.pathsep + ROOT, "OUTBOX_PROBE": self.probe}

    def deletes(self):
        """[(rows asked, rows deleted)] of every outbox delete so far."""
        if not os.path.exists(self.probe):
            return []
        with open(self.probe) as f:
            return [tuple(int(x) for x in line.split()) for line in f if line.strip()]


def registered(db):
    store = Store(db)
    try:
        return len(store.devices())
    finally:
        store.close()


def wait_until(predicate, what, procs, timeout=120):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "{}\n{}".format(what, "\n".join(
            p.tail() for p in procs))
        time.sleep(0.05)


def stop_outside_a_transaction(kind, db, inst, procs):
    """SIGSTOP ``inst`` where it holds no write lock: on SQLite, with the write lock taken
    here first (it waits for the instance's transaction to end, then holds the next one off);
    on PostgreSQL, again after a heartbeat while its session is not idle."""
    if kind == "sqlite":
        conn = sqlite3.connect(sqlite_path(db), timeout=60, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            inst.proc.send_signal(signal.SIGSTOP)
            conn.execute("ROLLBACK")
        finally:
            conn.close()
        return
    for _ in range(50):
        inst.proc.send_signal(signal.SIGSTOP)
        if set(session_states(db, inst.name)) <= {"idle"}:
            return  # (active: a statement, or an executemany's pipeline, under way)
        beat = heartbeat(db, inst.instance)
        inst.proc.send_signal(signal.SIGCONT)
        wait_heartbeat(db, inst.instance, beat, inst)
    raise AssertionError("never stopped outside a transaction\n" + "\n".join(
        p.tail() for p in procs))


def session_states(db, app):
    conn = Db(db)
    try:
        return [r[0] for r in conn.query("SELECT state FROM pg_stat_activity WHERE "
                                         "application_name = ?", (app,))]
    finally:
        conn.close()


@pytest.mark.slow
def test_a_resumed_holder_publishes_deletes_and_serves_nothing(
        db_kind, mosquitto, tmp_path, request):  # noqa: F811 - fixtures
    pg = request.getfixturevalue("postgres") if db_kind == "postgresql" else None
    db = url_of(db_kind, tmp_path, pg)
    fleet = SimulatedFleet(mosquitto.host, mosquitto.port, COUNT, name="fz", fetch=True)
    fleet.start()
    one = Probed(mosquitto, db, tmp_path, "one").start()
    two = Probed(mosquitto, db, tmp_path, "two")
    procs = [one, two]
    held = False
    try:
        wait_until(lambda: registered(db) >= COUNT, "registry", procs)
        two.start()
        for inst in procs:
            inst.instance, inst.client = inst.ready()
        by_name = {p.instance: p for p in procs}
        out = fleet_cli(["rollout"] + fp16_args() + [
            "--match", "fz-*", "--rollout-id", "ro-fz", "--db", db, "--store",
            os.path.join(str(tmp_path), "artifacts"), "--submit", "--detach", "--timeout",
            "600"])
        assert out.returncode == 0, out.stderr
        (owner, _h, epoch, _s), _t = wait_lease(db, "ro-fz", lambda r: r[0], "owned", procs)
        stale = by_name[owner]

        def succeeded():
            with fleet.lock:
                return fleet.succeeded

        # Mid-stream: devices fetching blocks, final statuses being cleared.
        wait_until(lambda: succeeded() >= COUNT // 10, "streaming", procs)
        stop_outside_a_transaction(db_kind, db, stale, procs)
        t0 = time.monotonic()
        in_flight = COUNT - succeeded()
        (_o, _h, new_epoch, _s), t1 = wait_lease(
            db, "ro-fz", lambda r: r[0] and r[0] != owner, "taken over", procs)
        record("sigstop_{}".format(db_kind), t1 - t0)
        assert t1 - t0 <= TAKEOVER_BOUND_S, t1 - t0
        assert new_epoch > epoch

        fleet.lock.acquire()  # the devices hold still: nothing new for anyone to answer
        held = True
        with open(mosquitto.log, "rb") as f:
            mark = len(f.read())
        with open(stale.log, "rb") as f:
            log_mark = len(f.read())
        deleted_before = len(stale.deletes())
        stale.proc.send_signal(signal.SIGCONT)
        # Resumed: it finds its deadline passed, drops what its client held, sits out a
        # lease and says when it acts on its own account again.
        wait_until(lambda: re.search(r"acting on its own account again",
                                     stale.text()[log_mark:]), "acting again", procs, 60)
        beat = heartbeat(db, stale.instance)
        wait_heartbeat(db, stale.instance, beat, stale)  # a tick of its loop after that
        sent = publishes(mosquitto, stale.client, mark)
        deleted = sum(n for _asked, n in stale.deletes()[deleted_before:])
        text = stale.text()[log_mark:]
        dropped = re.search(r"; (\d+) block request\(s\) and (\d+) message\(s\) queued in the "
                            r"MQTT client dropped so far\)", text)
        print("\nfencing[{}]: {} devices, {} in flight at the stop; takeover {:.1f} s; "
              "resumed holder: {} block request(s) and {} client message(s) dropped, "
              "{} published, {} outbox row(s) deleted".format(
                  db_kind, COUNT, in_flight, t1 - t0, dropped.group(1), dropped.group(2),
                  len(sent), deleted))
        assert sent == [], sent[:20]
        assert deleted == 0
        assert "rollout ro-fz: let go by" in text, text[-3000:]

        fleet.lock.release()
        held = False
        wait_lease(db, "ro-fz", lambda r: r[3] == "succeeded", "succeeded", procs, 180)
        jobs = [t for t in publishes(mosquitto, stale.client, mark) if "/jobs/" in t]
        assert jobs == [], jobs[:20]
        assert lease(db, "ro-fz")[0] != owner
        store = Store(db)
        try:
            assert store.rollout("ro-fz")["counts"] == {"SUCCEEDED": COUNT}
        finally:
            store.close()
    finally:
        if held:
            fleet.lock.release()
        one.kill()
        two.kill()
        fleet.stop()
