"""Fast, safe takeover between ``fleet serve`` instances (fleet.database.leases, instance_name),
on real PostgreSQL and SQLite, a real Mosquitto (logging every PUBLISH and its sender) and real
agents.

- The owner of a rollout is killed (SIGKILL): the other instance holds the rollout within
  ``TAKEOVER_BOUND_S`` under the default lease (docs/benchmarks.md records the figures). An
  owner stopped (SIGSTOP) and resumed after a takeover, at scale: test_fleet_fencing.py.
- Ten quick restarts under one (default) name take the rollout back at once, not after the
  lease (here 60 s, so that waiting it out could not pass for a quick takeover).
- Two live instances on one host (default names) get distinct names and both serve; a name a
  live instance holds is refused (``instance_in_use``).
"""

import os
import re
import signal
import time

import pytest

from agent.fleet.database.db import Db
from agent.fleet.database.store import Store
from tests.integration import test_fleet_multi as multi
from tests.integration.conftest import MOSQUITTO, Broker
from tests.integration.postgres import postgres  # noqa: F401 - fixture
from tests.integration.test_fleet_rollout import wait_status
from tests.integration.test_fleet_service import fleet_cli, fp16_args, wait_registered

# Takeover within 10 s by default (lease 6 s, ticks of 0.5 s); the bound leaves room for a
# loaded 2-core host (the measured figures are in docs/benchmarks.md).
TAKEOVER_BOUND_S = float(os.environ.get("TAKEOVER_BOUND_S", "20"))
TIMINGS = os.environ.get("TAKEOVER_TIMINGS")  # a file the measured figures are appended to


@pytest.fixture
def mosquitto(tmp_path):
    """The conftest's broker, logging every message and its sender (who published what)."""
    if not os.path.exists(MOSQUITTO):
        pytest.skip("mosquitto is not installed")
    workdir = tmp_path / "broker"
    workdir.mkdir()
    broker = Broker(workdir)
    with open(broker.config, "a") as f:
        f.write("log_dest stdout\nlog_type all\nconnection_messages true\n")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop(kill=False)


class Instance(multi.Instance):
    """``fleet serve`` with its default name and lease (``extra``: more options)."""

    def __init__(self, broker, db, workdir, label, extra=()):
        multi.Instance.__init__(self, broker, db, os.path.join(str(workdir), "artifacts"),
                                label, workdir, list(extra))

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies only once resumed
        multi.Instance.kill(self)

    def text(self):
        with open(self.log, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def wait_for(self, pattern, timeout=60):
        """The first match of ``pattern`` in the log (an event, polled)."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.text())
            if m:
                return m
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                (pattern, self.tail())
            time.sleep(0.1)

    def ready(self):
        """(instance name, MQTT client id) once serving."""
        m = self.wait_for(r"fleet service (\S+) \(pid \d+, MQTT client (\S+)\)")
        return m.group(1), m.group(2)


def lease(db, rid):
    """(owner, holder, epoch, state) of a rollout."""
    conn = Db(db)
    try:
        rows = conn.query("SELECT owner, lease_holder, lease_epoch, state FROM rollouts WHERE "
                          "rollout_id = ?", (rid,))
        return rows[0] if rows else (None, None, None, None)
    finally:
        conn.close()


def wait_lease(db, rid, predicate, what, procs, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        row = lease(db, rid)
        if predicate(row):
            return row, time.monotonic()
        assert time.monotonic() < deadline, "{}: {}\n{}".format(
            what, row, "\n".join(p.tail() for p in procs))
        time.sleep(0.05)


# The rollout's row without its ``updated``/``finished`` stamps: the new owner may stamp its
# finished rollout again on a later tick (under its own lease and epoch, which stay in the row).
ROLLOUT_COLUMNS = ("rollout_id, spec, state, outcome, reason, current_stage, halted, paused, "
                   "created, deadline, owner, lease_until, control, lease_epoch, lease_holder")


def snapshot(db, rid):
    """Everything the database holds of a rollout (its row's own time stamps aside)."""
    conn = Db(db)
    try:
        out = {t: sorted(conn.query("SELECT * FROM {} WHERE rollout_id = ?".format(t), (rid,)),
                         key=repr)
               for t in ("jobs", "job_history", "outbox")}
        out["rollouts"] = conn.query("SELECT {} FROM rollouts WHERE rollout_id = ?".format(
            ROLLOUT_COLUMNS), (rid,))
        return out
    finally:
        conn.close()


def heartbeat(db, instance):
    conn = Db(db)
    try:
        rows = conn.query("SELECT heartbeat FROM services WHERE instance = ?", (instance,))
        return rows[0][0] if rows else None
    finally:
        conn.close()


def wait_heartbeat(db, instance, after, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        beat = heartbeat(db, instance)
        if beat is not None and beat != after:
            return beat
        assert time.monotonic() < deadline and proc.proc.poll() is None, proc.tail()
        time.sleep(0.05)


def publishes(broker, client_id, since):
    """Topics ``client_id`` published after byte ``since`` of the broker's log."""
    with open(broker.log, "rb") as f:
        f.seek(since)
        text = f.read().decode("utf-8", "replace")
    return re.findall(r"Received PUBLISH from {} \([^']*'([^']+)'".format(re.escape(client_id)),
                      text)


def record(label, seconds):
    if TIMINGS:
        with open(TIMINGS, "a") as f:
            f.write("{} {:.2f}\n".format(label, seconds))


def submit(db, workdir, rid, device):
    out = fleet_cli(["rollout"] + fp16_args() + [
        "--devices", device, "--rollout-id", rid, "--db", db, "--store",
        os.path.join(str(workdir), "artifacts"), "--submit", "--detach", "--timeout", "600"])
    assert out.returncode == 0, out.stderr


def url_of(kind, tmp_path, pg):
    return pg.url if kind == "postgresql" else "sqlite:///" + str(tmp_path / "fleet.db")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_kind(request):
    return request.param


@pytest.mark.slow
def test_kill_9_takeover_within_the_bound(
        db_kind, mosquitto, agent_factory, tmp_path, request):
    pg = request.getfixturevalue("postgres") if db_kind == "postgresql" else None
    db = url_of(db_kind, tmp_path, pg)
    off = agent_factory("tk-off").start()
    wait_status(mosquitto, ["tk-off"], agents=[off])
    assert off.stop() == 0  # the rollouts wait for it: they are unfinished at each fault
    wait_status(mosquitto, ["tk-off"], online=False)
    # Default names and the default lease: two live instances on one host.
    one = Instance(mosquitto, db, tmp_path, "one").start()
    two = Instance(mosquitto, db, tmp_path, "two")
    procs = [one, two]
    try:
        wait_registered(db, ["tk-off"], one)
        two.start()
        names = dict(zip(("one", "two"), (one.ready(), two.ready())))
        assert names["one"][0] != names["two"][0], names
        by_name = {names["one"][0]: one, names["two"][0]: two}

        # kill -9 the owner of a rollout: the other takes over.
        submit(db, tmp_path, "ro-kill", "tk-off")
        (owner, _h, epoch, _s), _t = wait_lease(db, "ro-kill", lambda r: r[0], "owned", procs)
        victim = by_name[owner]
        victim.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        victim.proc.wait(10)
        (new_owner, _h, new_epoch, _s), t1 = wait_lease(
            db, "ro-kill", lambda r: r[0] and r[0] != owner, "taken over", procs)
        record("kill9_{}".format(db_kind), t1 - t0)
        assert t1 - t0 <= TAKEOVER_BOUND_S, t1 - t0
        assert new_epoch > epoch
        off.start()
        wait_lease(db, "ro-kill", lambda r: r[3] == "succeeded", "succeeded", procs, 180)
        store = Store(db)
        try:
            assert store.rollout("ro-kill")["counts"] == {"SUCCEEDED": 1}
        finally:
            store.close()
    finally:
        one.kill()
        two.kill()


@pytest.mark.slow
def test_ten_quick_restarts_take_the_rollout_back_at_once_and_a_live_name_is_refused(
        mosquitto, agent_factory, tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    dev = agent_factory("rs-a").start()
    wait_status(mosquitto, ["rs-a"], agents=[dev])
    assert dev.stop() == 0
    wait_status(mosquitto, ["rs-a"], online=False)
    lease_s = 60.0  # waiting it out would take a minute a restart
    svc = Instance(mosquitto, db, tmp_path, "svc", ["--lease", str(lease_s)]).start()
    try:
        name, _client = svc.ready()
        submit(db, tmp_path, "ro-restart", "rs-a")
        (_o, holder, _e, _s), _t = wait_lease(db, "ro-restart", lambda r: r[1], "owned", [svc])
        # A second process asking for the live one's name is refused at once.
        twin = Instance(mosquitto, db, tmp_path, "twin", ["--instance", name]).start()
        assert twin.proc.wait(60) == 2, twin.tail()
        assert "error [instance_in_use]" in twin.text(), twin.tail()
        waits = []
        for _ in range(10):
            svc.kill()
            t0 = time.monotonic()
            svc.start()
            (owner, new_holder, _e, _s), t1 = wait_lease(
                db, "ro-restart", lambda r, h=holder: r[1] and r[1] != h, "taken back", [svc])
            assert owner == name  # the same stable default name
            waits.append(t1 - t0)
            holder = new_holder
        for w in waits:
            record("restart_sqlite", w)
        assert max(waits) < lease_s / 2, waits
        dev.start()
        wait_lease(db, "ro-restart", lambda r: r[3] == "succeeded", "succeeded", [svc], 180)
    finally:
        svc.kill()


def test_epochs_fence_a_stale_holder_on_the_database_clock(db_kind, tmp_path, request):
    """The store's part: claims on the database's clock, an epoch per holder change, a stale
    holder's write refused whole, a dead predecessor's lease under the own name taken at once."""
    from agent.fleet.database import leases

    pg = request.getfixturevalue("postgres") if db_kind == "postgresql" else None
    store = Store(url_of(db_kind, tmp_path, pg))
    try:
        store.insert_rollout("ro-f", {}, [["d1"]], deadline=time.time() + 600)
        db = store.db
        assert abs(leases.db_now(db) - time.time()) < 5
        a = leases.holder_token("one")
        assert leases.claim(db, "one", a, 6.0) == {"ro-f": 1}
        assert leases.claim(db, "one", a, 6.0) == {"ro-f": 1}  # renewed, same epoch
        b = leases.holder_token("two")
        assert leases.claim(db, "two", b, 6.0) == {}  # held and fresh
        db.execute("UPDATE rollouts SET lease_until = lease_until - 7 WHERE rollout_id = 'ro-f'")
        assert leases.claim(db, "two", b, 6.0) == {"ro-f": 2}  # expired: taken, epoch 2
        before = snapshot(store.url, "ro-f")
        with pytest.raises(leases.LeaseLost):
            store.save_rollout("ro-f", {"current_stage": 0}, {"d1": (0, "SUCCEEDED", {})},
                               [("ro-f", "d1", "j", 1, "SUCCEEDED", "done", 1.0)],
                               [("t/x", b"stale", True)], fence=(a, 1, 6.0))
        assert snapshot(store.url, "ro-f") == before  # nothing of the stale write
        ids = store.save_rollout("ro-f", {"current_stage": 0}, {}, (), [("t/y", b"ok", True)],
                                 fence=(b, 2, 6.0))
        assert db.query("SELECT epoch FROM outbox WHERE id = ?", (ids[0],)) == [(2,)]
        # An acknowledged row leaves the outbox only under its sender's holder and epoch.
        store.outbox_done([(ids[0], ("ro-f", 2))], a)  # another holder
        store.outbox_done([(ids[0], ("ro-f", 1))], b)  # an older epoch
        assert db.query("SELECT id FROM outbox WHERE id = ?", (ids[0],)) == [(ids[0],)]
        store.outbox_done([(ids[0], ("ro-f", 2))], b)
        assert db.query("SELECT id FROM outbox WHERE id = ?", (ids[0],)) == []
        # The same name in another process (its predecessor dead): taken at once, epoch 3.
        b2 = leases.holder_token("two")
        assert leases.claim(db, "two", b2, 6.0) == {"ro-f": 3}
        assert lease(store.url, "ro-f")[1:3] == (b2, 3)
        with pytest.raises(leases.LeaseLost):  # the predecessor's epoch is fenced off
            store.save_rollout("ro-f", {"current_stage": 0}, {}, fence=(b, 2, 6.0))
    finally:
        store.close()
