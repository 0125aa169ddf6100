"""A real Triton serving what the daemon hands over: a daemon configured with the ``triton``
hand-off (explicit model control) deploys ``digits`` v1, then v2; each job ends SUCCEEDED only
once Triton reports the version ready and answers a request (the adapter's confirm commits
it), Triton answers inference with the new version, and requests made during the switch all
succeed; Triton restarted (explicit mode: nothing loaded) gets the committed version back from
the daemon's tick, reported in the models message and by ``models show``. The
repository holds ``backend: python`` versions (no TensorRT backend runs on these hosts; the
production path writes ``tensorrt_plan``)."""

import json
import os
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from agent.wire import protocol
from tests.integration.test_named_models import cli, named
from tests.integration.test_triton_handoff import triton  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow


def infer(url, x):
    body = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.reshape(-1).tolist()}]}).encode()
    request = urllib.request.Request(url + "/v2/models/digits/infer", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        doc = json.loads(response.read())
    return doc["model_version"], np.asarray(doc["outputs"][0]["data"]).reshape(x.shape[0], -1)


def test_the_daemon_hands_versions_to_a_real_triton(triton, controller,  # noqa: F811
                                                     agent_factory, digits_files):
    extra = ("handoff:\n  - type: triton\n    models: [digits]\n    repository: {}\n"
             "    url: {}\n    backend: python\n    timeout_s: 60\n").format(
                 triton.repository, triton.url)
    agent = agent_factory(extra_config=extra).start()
    controller.wait_online()
    x = np.load(digits_files["calibration"])["input"][:4].astype(np.float32)

    named(controller, digits_files, "t-1", "digits", "v1")
    final = controller.wait_state("t-1", protocol.TERMINAL_STATES, timeout=180)
    assert final["state"] == "SUCCEEDED", (final, agent.log_tail(), triton.tail())
    assert final["result"]["model"] == {"name": "digits", "version": "v1", "previous": None,
                                        "state": "committed"}
    served, logits = infer(triton.url, x)
    assert served == "1" and logits.shape == (4, 10)

    failures, versions, stop = [], [], threading.Event()

    def load():
        for _ in range(5000):
            if stop.is_set():
                return
            try:
                versions.append(infer(triton.url, x)[0])
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                failures.append(repr(exc))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        named(controller, digits_files, "t-2", "digits", "v2")
        final = controller.wait_state("t-2", protocol.TERMINAL_STATES, timeout=180)
    finally:
        stop.set()
        thread.join(30)
    assert final["state"] == "SUCCEEDED", (final, agent.log_tail(), triton.tail())
    assert final["result"]["model"]["previous"] == "v1"
    assert infer(triton.url, x)[0] == "2"
    assert failures == [] and versions and versions[0] == "1"
    mapping = json.load(open(os.path.join(triton.repository, "digits",
                                          "jetson-agent-versions.json")))
    assert [e["version"] for e in mapping["versions"]] == ["v1", "v2"]

    # Triton restarts (explicit mode: it loads nothing); the daemon's tick notices and loads
    # the committed version again, and says so in the models message.
    triton.stop()
    triton.start()
    controller.wait_for(lambda: next((m for m in controller.models[-1]["models"]
                                      if m["name"] == "digits" and "handoff" in m), None)
                        if controller.models else None, 60, "the models message to report it")
    note = [m for m in controller.models[-1]["models"] if m["name"] == "digits"][0]["handoff"]
    assert "digits@v2 (Triton version 2) loaded again after a Triton restart" in note or \
        "digits@v2 (Triton version 2) loaded again (Triton did not have it)" in note, note
    assert infer(triton.url, x)[0] == "2"
    shown = cli("models", "show", "digits", "--state-dir", agent.state_dir, "--json")
    assert shown["handoff"] == note  # `models show` says it too
    assert agent.stop() == 0
