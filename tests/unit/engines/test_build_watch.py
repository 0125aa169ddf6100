"""Builds you can watch and bound (issue 34, item 5), through the version-faithful fake
TensorRT: IProgressMonitor's steps reach the progress callback (the CLI's bar, the job's
status), a callback answering False cancels the build, and builder.memory_limit caps the
builder's memory pools."""

import os

import pytest

from agent.engines.backends import tensorrt as trt_backend
from agent.engines.backends import tensorrt_network
from agent.engines.backends.base import BuildPlan
from agent.engines.backends.tensorrt_plan import MEMORY_SHARE, build_memory_limit
from agent.errors import AgentError
from tests import fake_trt
from tests.models import fp16_max_model
from tests.trt_builds import save

GIB = 1 << 30


@pytest.fixture(autouse=True)
def _fresh_logger(monkeypatch):
    monkeypatch.setattr(tensorrt_network, "_LOGGER", None)


def _build(monkeypatch, tmp_path, profile, progress, memory_limit=None, plan=None):
    trt, _ = fake_trt.install(monkeypatch, profile)
    backend = trt_backend.TensorRTBackend(trt.__version__)
    backend.memory_limit = memory_limit
    path = save(fp16_max_model(), tmp_path)
    engine = str(tmp_path / "e.engine")
    result = backend.build(path, plan or BuildPlan("fp16"), engine, progress)
    return result, trt


@pytest.mark.parametrize("profile", ["10.3", "10.13", "11.x"])
def test_progress_monitor_steps_reach_the_callback(monkeypatch, tmp_path, profile):
    seen = []
    _, trt = _build(monkeypatch, tmp_path, profile, lambda *a: seen.append(a))
    steps = len(trt._driver.builds[-1]["layers"])
    building = [(d, t) for s, d, t in seen if s == "building"]
    assert (0, steps) in building and (steps, steps) in building
    assert [d for d, t in building if t == steps] == sorted(d for d, t in building if t == steps)


def test_before_10_a_build_reports_its_phases_only(monkeypatch, tmp_path):
    seen = []
    _build(monkeypatch, tmp_path, "8.6", lambda *a: seen.append(a))
    assert seen == [("building", 0, 1), ("building", 1, 1)]


@pytest.mark.parametrize("profile", ["10.3", "11.x"])
def test_a_callback_answering_false_cancels_the_build(monkeypatch, tmp_path, profile):
    calls = []

    def progress(stage, done, total):
        calls.append(done)
        return False if len(calls) > 3 else None

    with pytest.raises(AgentError) as err:
        _build(monkeypatch, tmp_path, profile, progress)
    assert err.value.code == "cancelled" and "progress monitor" in err.value.message
    assert not os.path.exists(str(tmp_path / "e.engine"))


def test_ctrl_c_during_a_build_stops_it_and_interrupts(monkeypatch, tmp_path):
    def progress(stage, done, total):
        if done == 1:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        _build(monkeypatch, tmp_path, "10.3", progress)


@pytest.mark.parametrize("profile,pools", [
    ("10.3", {"WORKSPACE": GIB, "TACTIC_DRAM": GIB}),
    ("8.6", {"WORKSPACE": GIB, "TACTIC_DRAM": GIB}),
    ("8.5", {"WORKSPACE": GIB}),  # no TACTIC_DRAM pool before 8.6
])
def test_memory_limit_caps_the_builder_pools(monkeypatch, tmp_path, profile, pools):
    result, trt = _build(monkeypatch, tmp_path, profile, lambda *a: None, memory_limit=GIB)
    assert trt._driver.builds[-1]["memory_pools"] == pools
    assert result.details["memory_pools"] == pools


def test_a_smaller_workspace_stays_under_the_cap(monkeypatch, tmp_path):
    plan = BuildPlan("fp16", workspace_bytes=64 << 20)
    result, trt = _build(monkeypatch, tmp_path, "10.3", lambda *a: None, memory_limit=GIB,
                         plan=plan)
    assert trt._driver.builds[-1]["memory_pools"] == {"WORKSPACE": 64 << 20,
                                                      "TACTIC_DRAM": GIB}


def test_default_memory_limit_is_a_share_of_ram_on_shared_memory_boards():
    assert build_memory_limit(None, 8 * GIB, shared_memory=True) == int(8 * GIB * MEMORY_SHARE)
    assert build_memory_limit(None, 64 * GIB, shared_memory=False) is None
    assert build_memory_limit(0, 8 * GIB, shared_memory=True) is None  # 0: no cap
    assert build_memory_limit(2 * GIB, 8 * GIB, shared_memory=False) == 2 * GIB


def test_builder_memory_limit_in_the_daemon_config(tmp_path):
    from agent.device import config

    path = tmp_path / "agent.yaml"
    path.write_text("builder:\n  memory_limit: 2GiB\n")
    assert config.load(str(path), env={}).builder.memory_limit == 2 * GIB
    assert config.load(None, env={}).builder.memory_limit is None  # the share of RAM
    path.write_text("builder:\n  memory_limit: -1\n")
    with pytest.raises(AgentError) as err:
        config.load(str(path), env={})
    assert err.value.code == "bad_config" and "builder.memory_limit" in err.value.message


def test_the_worker_answers_false_once_its_job_is_to_stop():
    # The worker's progress callback: the daemon's SIGTERM (a cancelled job) sets the flag,
    # and the build's next step ends the build.
    from agent.worker.context import Progress

    stop, lines = [False], []
    progress = Progress(lines.append, should_stop=lambda: stop[0])
    assert progress("building", 1, 10) is None
    stop[0] = True
    assert progress("building", 2, 10) is False
    assert lines[0] == {"type": "progress", "stage": "building", "done": 1, "of": 10}
