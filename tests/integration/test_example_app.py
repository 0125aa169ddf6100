"""The example app (examples/app/) on a models_dir laid out as the daemon lays it out, under load
from its load generator: v1 -> v2 without a failed request, each version checked on the app's
stored rows and reported healthy over the (stand-in) app socket; the broken v3 reported
unhealthy and never served, v2 kept; the agent's rollback to v2 changes nothing for it."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APP = os.path.join(ROOT, "examples", "app")
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, APP)

import demo_flow  # noqa: E402
import fake_agent  # noqa: E402
from loadgen import LoadGen  # noqa: E402


@pytest.fixture
def models_dir(tmp_path):
    d = str(tmp_path / "models")
    for version, folder in demo_flow.VERSIONS:
        fake_agent.install_version(d, "digits", version,
                                   os.path.join(EXAMPLES, folder, "model.onnx"),
                                   {"job_id": "job-" + version})
    return d


def test_app_switches_without_failing_and_reports_health(tmp_path, models_dir):
    sock = fake_agent.SocketRecorder(str(tmp_path / "app.sock"))
    app = demo_flow.AppProcess(str(tmp_path / "app"), "digits", models_dir, sock.path,
                               extra=["--donate-every", "10"])
    gen = None
    try:
        t_v1 = fake_agent.activate(models_dir, "digits", "v1")
        app.start()
        gen = LoadGen(app.url, threads=3).start()
        first = app.wait_serving("v1", 30)
        assert first["activated"] == pytest.approx(t_v1)
        sock.wait_for(lambda r: r.get("version") == "v1" and r.get("ok") is True)
        # every 10th request's rows go to the agent (never holding the request up)
        donated = sock.wait_for(lambda r: r.get("op") == "donate")
        assert donated["name"] == "digits" and donated["bytes"] > 0

        fake_agent.activate(models_dir, "digits", "v2")
        switch = app.wait_serving("v2", 30)
        assert 0 < switch["switch_s"] < 10
        health = sock.wait_for(lambda r: r.get("version") == "v2")
        assert health == {"op": "health", "name": "digits", "version": "v2", "ok": True,
                          "detail": "50 stored rows answered correctly"}

        fake_agent.activate(models_dir, "digits", "v3")
        bad = sock.wait_for(lambda r: r.get("version") == "v3")
        assert bad["ok"] is False
        assert "expected label accuracy >= 90% on 50 stored rows, found" in bad["detail"]
        stats = app.stats()
        assert stats["serving"] == "v2"
        assert [r["version"] for r in stats["rejected"]] == ["v3"]

        fake_agent.activate(models_dir, "digits", "v2")  # the agent's rollback
        served_before = app.stats()["requests"]
        app.wait(lambda s: s["requests"] > served_before + 20, 30, "more requests")
        summary = gen.stop()
        gen = None
    finally:
        if gen is not None:
            gen.stop()
        final = app.stop()
        sock.close()
    assert summary["failed"] == 0, summary["failures"]
    assert set(summary["by_version"]) == {"v1", "v2"}
    assert final["failed"] == 0 and final["serving"] == "v2"
    assert [w["version"] for w in final["switches"]] == ["v1", "v2"]
    # every health report reached the socket
    assert all(r["sent"] for r in final["reports"])
    assert [(r["version"], r["ok"]) for r in final["reports"]] == [
        ("v1", True), ("v2", True), ("v3", False)]


def test_app_refuses_an_engine_that_is_not_whole(tmp_path, models_dir):
    """meta.json's engine size is the check: a truncated engine is reported, not served."""
    vdir = os.path.join(models_dir, "digits", "v1")
    with open(os.path.join(vdir, "model.engine"), "r+b") as f:
        f.truncate(100)
    sock = fake_agent.SocketRecorder(str(tmp_path / "app.sock"))
    app = demo_flow.AppProcess(str(tmp_path / "app"), "digits", models_dir, sock.path)
    try:
        fake_agent.activate(models_dir, "digits", "v1")
        app.start()
        bad = sock.wait_for(lambda r: r.get("version") == "v1")
        assert bad["ok"] is False and "bytes (meta.json), found 100" in bad["detail"]
        assert app.stats()["serving"] is None
    finally:
        app.stop()
        sock.close()
