"""The Triton hand-off through a real ``tritonserver``'s life: readiness is a real inference (a
version whose engine fails every request is refused with Triton's own error: its warmup
sample fails the load; the previous one keeps serving), a restart in explicit mode (which
loads nothing) ends with the committed versions loaded again by ``heal()`` (loads through
Triton's gRPC endpoint), ``keep_versions`` is the number of versions kept on disk and
``loaded_versions`` the number Triton holds (one by default; a rollback to a kept version
works), and the repository's files and folders have the documented modes."""

import os
import stat

import pytest

from agent.device.handoff.triton import from_config
from agent.errors import AgentError
from tests.integration.test_triton_handoff import (
    infer,
    make_version,
    scale_model,
    triton,  # noqa: F401 - the fixture
)

pytestmark = pytest.mark.slow


def adapter_for(server, **extra):
    section = {"repository": server.repository, "url": server.url, "backend": "python",
               "timeout_s": 60}
    section.update(extra)
    return from_config(section, "handoff[0]")


def activate(adapter, new, previous):
    """prepare, switch, confirm, and commit when confirmed (as the daemon does)."""
    adapter.prepare(new, previous)
    adapter.switch(new, previous)
    confirmed = adapter.confirm(new)
    if confirmed:
        adapter.commit(new, previous)
    return confirmed


def test_a_version_that_fails_inference_is_refused_with_tritons_error(triton,  # noqa: F811
                                                                       tmp_path):
    models = tmp_path / "models"
    v1 = make_version(models, "v1", scale_model(1.0).SerializeToString())
    # Its engine takes 5 values where its meta.json (and so config.pbtxt and every client) says
    # 4: it would load, but every request fails. config.pbtxt's model_warmup runs one request
    # of zeros before Triton calls the version ready, so Triton refuses the load itself.
    v2 = make_version(models, "v2", scale_model(2.0, width=5).SerializeToString())
    adapter = adapter_for(triton)
    assert activate(adapter, v1, None) is True

    adapter.prepare(v2, v1)
    adapter.switch(v2, v1)
    assert not adapter.ready("det", 2)
    with pytest.raises(AgentError) as info:
        adapter.confirm(v2)
    message = info.value.message
    assert info.value.code == "handoff_failed" and "det@v2" in message
    assert "HTTP 4" in message or "HTTP 5" in message
    assert "warmup" in message and "invalid" in message.lower(), message  # Triton's text
    assert adapter.last_error(v2) in message
    assert infer(triton.url) == (1.0, "1")  # v1 served all along
    adapter.revert(v1, v2)
    assert infer(triton.url) == (1.0, "1")
    assert not adapter.ready("det", 2)


def test_a_restarted_triton_gets_the_committed_versions_back(triton, tmp_path):  # noqa: F811
    models = tmp_path / "models"
    v1 = make_version(models, "v1", scale_model(1.0).SerializeToString())
    v2 = make_version(models, "v2", scale_model(2.0).SerializeToString())
    adapter = adapter_for(triton, grpc_url=triton.grpc_target)  # loads through gRPC
    assert activate(adapter, v1, None) is True
    assert activate(adapter, v2, v1) is True
    assert adapter.heal([v2]) == {}  # all there: nothing to do

    triton.stop()
    assert adapter.heal([v2]) == {}  # down: nothing to load into, asked again next tick
    triton.start()  # explicit mode: nothing loaded
    assert not adapter.ready("det", 2)
    notes = adapter.heal([v2])
    assert set(notes) == {"det"}
    assert "det@v2 (Triton version 2) loaded again after a Triton restart" in notes["det"]
    assert infer(triton.url) == (2.0, "2")
    assert not adapter.ready("det", 1)  # kept on disk only: config.pbtxt lists v2 alone
    assert adapter.heal([v2]) == {}


def test_keep_versions_is_what_triton_holds_and_files_have_the_documented_modes(
        triton, tmp_path):  # noqa: F811
    models = tmp_path / "models"
    versions = [make_version(models, "v{}".format(i), scale_model(float(i)).SerializeToString())
                for i in range(1, 5)]
    adapter = adapter_for(triton, keep_versions=3, loaded_versions=2)
    previous = None
    for v in versions:
        assert activate(adapter, v, previous) is True
        previous = v
    model_dir = os.path.join(triton.repository, "det")
    config = open(os.path.join(model_dir, "config.pbtxt")).read()
    assert "versions: [ 3, 4 ]" in config
    assert [adapter.ready("det", n) for n in (1, 2, 3, 4)] == [False, False, True, True]
    assert sorted(os.listdir(model_dir)) == ["2", "3", "4", "config.pbtxt",
                                             "jetson-agent-versions.json"]

    def mode(*parts):
        return stat.S_IMODE(os.stat(os.path.join(model_dir, *parts)).st_mode)

    assert mode() == 0o750 and mode("4") == 0o750
    assert mode("config.pbtxt") == 0o640 and mode("4", "model.plan") == 0o640
    assert mode("4", "meta.json") == 0o640 and mode("jetson-agent-versions.json") == 0o640

    one = adapter_for(triton, keep_versions=1)
    v5 = make_version(models, "v5", scale_model(5.0).SerializeToString())
    assert activate(one, v5, versions[-1]) is True
    assert [one.ready("det", n) for n in (2, 3, 4, 5)] == [False, False, False, True]
    assert infer(triton.url) == (5.0, "5")


def test_triton_holds_one_version_by_default_and_the_kept_one_is_a_rollback_target(
        triton, tmp_path):  # noqa: F811
    models = tmp_path / "models"
    v1 = make_version(models, "v1", scale_model(1.0).SerializeToString())
    v2 = make_version(models, "v2", scale_model(2.0).SerializeToString())
    v3 = make_version(models, "v3", b"not an engine at all")
    adapter = adapter_for(triton, grpc_url=triton.grpc_target)  # the defaults: keep 2, load 1
    model_dir = os.path.join(triton.repository, "det")
    assert activate(adapter, v1, None) is True
    assert activate(adapter, v2, v1) is True
    assert [adapter.ready("det", n) for n in (1, 2)] == [False, True]  # one in memory ...
    assert {"1", "2"} <= set(os.listdir(model_dir))  # ... two on disk
    assert "versions: [ 2 ]" in open(os.path.join(model_dir, "config.pbtxt")).read()

    adapter.revert(v1, v2)  # v2 rolled back: the kept v1 folder is loaded again, none added
    assert infer(triton.url) == (1.0, "1")
    assert [adapter.ready("det", n) for n in (1, 2)] == [True, False]
    assert sorted(os.listdir(model_dir)) == ["1", "config.pbtxt", "jetson-agent-versions.json"]

    adapter.prepare(v3, v1)
    adapter.switch(v3, v1)  # Triton refuses the load and keeps serving v1
    with pytest.raises(AgentError):
        adapter.confirm(v3)
    adapter.revert(v1, v3)
    assert infer(triton.url) == (1.0, "1")
    assert activate(adapter, v2, v1) is True  # and forward again
    assert infer(triton.url) == (2.0, "2")
    assert [adapter.ready("det", n) for n in (1, 2)] == [False, True]
