"""The fault suite (``suite.py``): issue 33's birth flood, on an OPEN broker (anyone may publish)
and on the shipped TLS+ACL broker (the attacker a broker account never admitted, ``intruder``),
with a real daemon admitted by the keys list and a real ``fleet serve``.

Signed ~60 KB births for made-up ids (random keys) while an unrelated rollout runs: the
service's event queue keeps the messages of devices not admitted within one small shared
budget (agent.fleet.transfer.bytequeue), so the service stays within 2x its idle RSS and the
rollout within 1.5x its quiet time. ``JETSON_AGENT_FLOOD_BIRTHS`` sets the flood's size
(default 3,000 here; docs/benchmarks.md has the 40,000 figure)."""

import os
import threading
import time

from agent.wire import device_identity, protocol, status_messages
from tests.integration.faults.suite import fault, finish, started
from tests.integration.faults.test_faults_identity import T, arena  # noqa: F401 - the fixture
from tests.integration.test_fleet_service import (
    fleet_cli,
    fp16_args,
    wait_registered,
    wait_rollout,
)

BIRTHS = int(os.environ.get("JETSON_AGENT_FLOOD_BIRTHS", "3000"))
PAD = 58000  # a birth of about 60 KB (the status limit is 64 KiB)


def rss_mb(pid):
    with open("/proc/{}/status".format(pid)) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmRSS for {}".format(pid))


def rollout(db, rid, service):
    """One rollout to f-0, submitted and waited for: its wall time (s)."""
    t0 = time.monotonic()
    out = fleet_cli(["rollout"] + fp16_args() + ["--devices", "f-0", "--rollout-id", rid,
                                                 "--db", db, "--submit", "--detach"])
    assert out.returncode == 0, out.stderr
    report = wait_rollout(db, rid, lambda r: r["state"] in ("succeeded", "failed", "aborted"),
                          service, timeout=300)
    assert report["state"] == "succeeded", report
    return time.monotonic() - t0


def flood(broker, tmp_path, count, done):
    """``count`` signed ~60 KB births for made-up ids, four random keys, as fast as the
    attacker's client publishes them."""
    keys = [device_identity.create_device_key(str(tmp_path / "flood{}.key".format(i)))
            for i in range(4)]
    attacker = broker.client("intruder")
    try:
        for n in range(count):
            dev = "made-up-{:06d}".format(n)
            key = keys[n % len(keys)]
            platform = {"board": "Bogus", "backend": "onnxruntime", "identity": key.identity(),
                        "pad": "x" * PAD}
            body = protocol.encode(status_messages.status_message(dev, True, 1, "9.9", platform,
                                                                  [], ts=time.time()))
            handle = attacker.publish(T.status(dev), body, user_properties=device_identity
                                      .ReportSigner(key, dev, 1).properties(T.status(dev), body))
            if n % 200 == 199:
                handle.wait(60)  # paced by the broker's acknowledgements, not held in memory
    finally:
        attacker.stop()
        done.set()


def test_a_birth_flood_keeps_the_service_within_its_rss_and_rollout_time(arena, tmp_path):  # noqa: E501,F811
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    agent = started(arena.agent("f-0"))
    service = arena.service(db)
    try:
        wait_registered(db, ["f-0"], service, timeout=120)
        rollout(db, "ro-warm", service)  # the model is on the device and the engine built
        quiet = rollout(db, "ro-quiet", service)
        idle = rss_mb(service.proc.pid)
        done = threading.Event()
        attack = threading.Thread(target=flood, args=(arena, tmp_path, BIRTHS, done),
                                  daemon=True)
        peak = [idle]

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_mb(service.proc.pid))
                done.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        t0 = time.monotonic()
        attack.start()
        sampler.start()
        during = rollout(db, "ro-flood", service)
        attack.join(600)
        took = time.monotonic() - t0
        sampler.join(10)
        after = rss_mb(service.proc.pid)
        peak[0] = max(peak[0], after)
        fault("birth_flood", BIRTHS)
        print("\n{} broker, {} signed ~60 KB births in {:.1f} s: service RSS {:.0f} MB idle, "
              "{:.0f} MB peak ({:.2f}x), {:.0f} MB after; rollout {:.1f} s quiet, {:.1f} s "
              "under the flood ({:.2f}x)".format(arena.kind, BIRTHS, took, idle, peak[0],
                                                 peak[0] / idle, after, quiet, during,
                                                 during / quiet))
        assert peak[0] <= 2 * idle, (idle, peak[0])
        # The goal (1.5x its quiet time) is measured in docs/benchmarks.md; on a shared CI host
        # a timed test only catches the unbounded slowdown the flood once caused (334 s).
        assert during <= 3 * quiet + 10.0, (quiet, during, service.tail())
        assert service.proc.poll() is None
    finally:
        service.kill()
        finish(agent)
