"""Live inputs, the parts below the daemon: the donation over a real app socket (payload read,
hostile sizes refused, a second donation in hand dropped), the sample ring's bounds and its
checks against the model's inputs, and the live check's and the field's figures."""

import io
import json
import os
import shutil
import socket
import tempfile
import threading

import numpy as np
import pytest

from agent import client
from agent.device.app.server import MAX_PAYLOAD, AppSocket
from agent.device.models.live_samples import SampleStore, check_inputs
from agent.errors import AgentError
from agent.precision.live import calibration_inputs, compare, field_ranges, load_rows

SPECS = [{"name": "input", "shape": ["N", 4], "dtype": "float32"}]


def npz(**arrays):
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


@pytest.fixture
def models_dir(tmp_path):
    folder = tmp_path / "models" / "det" / "v1"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"inputs": SPECS}))
    os.symlink("v1", str(tmp_path / "models" / "det" / "current"))
    return str(tmp_path / "models")


def test_the_ring_keeps_the_newest_rows_within_its_caps(tmp_path, models_dir):
    store = SampleStore(str(tmp_path / "samples"), keep=10, keep_bytes=1 << 20)
    for i in range(4):
        reply = store.donate(models_dir, "det", npz(input=np.full((4, 4), i, np.float32)))
        assert reply["kept"] == 4
    assert store.count("det") == 8  # 16 donated, the oldest donations went
    rows = store.load("det")["input"]
    assert rows.shape == (8, 4) and rows[0, 0] == 2 and rows[-1, 0] == 3
    assert load_rows(store.newest("det"), 3)["input"].shape == (3, 4)
    one = store.donate(models_dir, "det", npz(input=np.ones(4, np.float32)))  # one sample
    assert one["kept"] == 1
    for f in os.listdir(store.dir("det")):
        assert os.stat(os.path.join(store.dir("det"), f)).st_mode & 0o077 == 0  # private
    small = SampleStore(str(tmp_path / "small"), keep=1000, keep_bytes=1 << 16)
    for _ in range(12):
        small.donate(models_dir, "det", npz(input=np.zeros((256, 4), np.float32)))
    assert sum(f[3] for f in small.files("det")) <= 1 << 16


@pytest.mark.parametrize("arrays, found", [
    ({"image": np.zeros((1, 4), np.float32)}, "expected inputs input, found image"),
    ({"input": np.zeros((1, 4), np.float64)}, "expected dtype float32, found float64"),
    ({"input": np.zeros((2, 5), np.float32)}, "expected shape ['N', 4]"),
    ({"input": np.zeros((0, 4), np.float32)}, "same number (>= 1) of rows"),
    ({"input": np.full((1, 4), np.nan, np.float32)}, "expected finite values"),
])
def test_a_donation_unlike_the_model_inputs_is_refused(arrays, found):
    with pytest.raises(AgentError) as info:
        check_inputs(arrays, SPECS, "donation")
    assert info.value.code == "bad_donation" and found in info.value.message


def test_hostile_donations_are_refused_with_codes(tmp_path, models_dir):
    store = SampleStore(str(tmp_path / "samples"), keep=8, keep_bytes=1 << 16)
    cases = [(npz(input=np.zeros((9, 4), np.float32)), "at most 8 rows"),
             (b"x" * ((1 << 16) + 1), "at most 65,536 bytes"),
             (b"PK\x03\x04 not a zip", ""),
             (npz(input=np.zeros((1, 4), np.float32)), "current version")]
    for i, (payload, text) in enumerate(cases):
        name = "det" if i < 3 else "gone"
        with pytest.raises(AgentError) as info:
            store.donate(models_dir, name, payload)
        assert info.value.code == "bad_donation" and text in info.value.message, info.value
    with pytest.raises(AgentError) as info:
        store.donate(models_dir, "../det", b"")
    assert info.value.code == "bad_model_name"
    assert store.count("det") == 0


@pytest.fixture
def donating(tmp_path, models_dir):
    path = tempfile.mkdtemp(prefix="appsock-", dir="/tmp")
    store = SampleStore(str(tmp_path / "samples"), keep=64, keep_bytes=1 << 20)
    gate, entered = threading.Event(), threading.Event()

    def donate(name, payload):
        entered.set()
        gate.wait(10)
        return store.donate(models_dir, name, payload)

    gate.set()
    sock = AppSocket(os.path.join(path, "app.sock"), [], [], lambda r, p: {"ok": True},
                     donate=donate).start()
    try:
        yield sock.path, store, gate, entered
    finally:
        sock.close()
        shutil.rmtree(path, ignore_errors=True)


def test_the_client_donates_over_the_socket_and_never_waits(donating):
    path, store, gate, entered = donating
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    reply = client.donate("det", {"input": x}, socket_path=path, wait=True)
    assert reply["ok"] and reply["kept"] == 3 and store.count("det") == 3
    with pytest.raises(client.ClientError) as info:
        client.request({"op": "donate", "name": "det", "bytes": MAX_PAYLOAD + 1}, path)
    assert info.value.code == "bad_donation"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # the payload ends early
        s.settimeout(10)
        s.connect(path)
        s.sendall(b'{"op": "donate", "name": "det", "bytes": 100}\n' + b"x" * 10)
        s.shutdown(socket.SHUT_WR)
        reply = json.loads(s.makefile("rb").readline())
    assert reply["error"]["code"] == "bad_donation" and "found 10 and the end" in \
        reply["error"]["message"]
    # One donation in hand: another is dropped at once, and says so.
    gate.clear()
    entered.clear()
    first = threading.Thread(target=client.donate, args=("det", {"input": x}),
                             kwargs={"socket_path": path, "wait": True})
    first.start()
    try:
        assert entered.wait(10)  # the first is in the agent's hands
        with pytest.raises(client.ClientError) as info:
            client.donate("det", {"input": x}, socket_path=path, wait=True)
        assert info.value.code == "rate_limited" and "dropped" in info.value.message
    finally:
        gate.set()
        first.join(10)
    # Not waiting: queued for the sender thread (or dropped while one is on its way).
    out = client.donate("det", {"input": x[0]}, socket_path=path)
    assert out.get("queued") or out.get("dropped")
    with pytest.raises(client.ClientError) as info:
        client.donate("det", {"input": np.array([object()])}, socket_path=path)
    assert info.value.code == "bad_donation"


def test_compare_refuses_rotated_classes_and_names_the_worst_rows():
    rng = np.random.RandomState(0)
    logits = rng.randn(40, 10).astype(np.float32)
    same = compare({"logits": logits}, {"logits": logits.copy()}, 0.95, 0.0, "mean")
    assert same["passed"] and same["agreement"] == 1.0 and same["worst"] == []
    rotated = compare({"logits": np.roll(logits, 1, axis=1)}, {"logits": logits}, 0.95, 0.0,
                      "mean")
    assert not rotated["passed"] and rotated["agreement"] < 0.2 and len(rotated["worst"]) == 5
    boxes = rng.rand(40, 1).astype(np.float32)  # not classifier-like: the error decides
    moved = boxes.copy()
    moved[7] += 1.0
    off = compare({"box": moved}, {"box": boxes}, 0.95, 0.01, "mean")
    assert not off["passed"] and off["agreement"] is None and off["worst"][0] == 7
    assert compare({"box": moved}, {"box": boxes}, 0.95, 0.0, "mean")["passed"]
    moved[3] = np.nan  # a candidate that answers NaN never passes
    nan = compare({"box": moved}, {"box": boxes}, 0.95, 0.0, "mean")
    assert not nan["passed"] and nan["error"] is None and nan["outputs"]["box"]["error"] is None
    json.dumps(nan, allow_nan=False)


class Doubling(object):
    """Activations of a model whose one hidden tensor is twice its input."""

    def run(self, feeds):
        return {"input": feeds["input"], "hidden": feeds["input"] * 2.0}


def test_field_ranges_count_activations_beyond_the_calibrated_range(tmp_path):
    x = np.linspace(-1, 1, 400, dtype=np.float32).reshape(100, 4)
    (tmp_path / "calib").mkdir()
    np.savez(str(tmp_path / "calib" / "shard_000.npz"), input=x)
    reference = calibration_inputs(str(tmp_path / "calib"))
    assert reference["input"]["max"] == 1.0 and abs(sum(reference["input"]["hist"]) - 1) < 1e-5
    amax = {"input": 1.0, "hidden": 2.0}
    calm = field_ranges(Doubling(), amax, {"input": x}, None, 0.01, reference)
    assert calm["clip_max"] == 0.0 and calm["stale"] == [] and calm["samples"] == 100
    assert calm["inputs"]["input"]["drift"] == {"mean_shift": 0.0, "hist_distance": 0.0,
                                                "hist_noise": 0.111037}
    wide = field_ranges(Doubling(), amax, {"input": x * 3.0}, None, 0.01, reference)
    assert wide["clip_rate"]["hidden"] > 0.6 and set(wide["stale"]) == {"input", "hidden"}
    assert wide["inputs"]["input"]["outside"] > 0.6 and wide["inputs"]["input"]["max"] == 3.0
    assert wide["inputs"]["input"]["drift"]["hist_distance"] > 0.6
    fixed = field_ranges(Doubling(), amax, {"input": x[:10]}, 4, 0.01)  # batch 4: 8 rows
    assert fixed["samples"] == 8


def test_inputs_that_drift_without_clipping_are_named_and_few_rows_are_not(tmp_path):
    x = np.linspace(-1, 1, 400, dtype=np.float32).reshape(100, 4)
    reference = {"input": calibration_inputs_of(tmp_path, x)}
    amax = {"input": 1.0, "hidden": 2.0}
    squeezed = field_ranges(Doubling(), amax, {"input": x * 0.25}, None, 0.01, reference, 0.2)
    assert squeezed["clip_max"] == 0.0 and squeezed["stale"] == []
    assert squeezed["drifted"] == ["input"] and squeezed["max_drift"] == 0.2
    assert field_ranges(Doubling(), amax, {"input": x * 0.25}, None, 0.01, reference,
                        0.0)["drifted"] == []  # 0: not checked
    moved = field_ranges(Doubling(), amax, {"input": x * 0.5 + 0.5}, None, 0.01, reference,
                         0.2)  # the mean moved, still within the calibrated range
    assert moved["drifted"] == ["input"] and moved["stale"] == []
    # Four rows drawn from the calibration set itself are far from its histogram by chance
    # alone: the noise allowance keeps them from reading as drift.
    few = field_ranges(Doubling(), amax, {"input": x[[3, 40, 61, 97]]}, None, 0.01,
                       reference, 0.2)
    d = few["inputs"]["input"]["drift"]
    assert d["hist_distance"] > 0.5 and d["hist_noise"] > 0.4 and few["drifted"] == []


def calibration_inputs_of(tmp_path, x):
    np.savez(str(tmp_path / "calib.npz"), input=x)
    return calibration_inputs(str(tmp_path / "calib.npz"))["input"]


def test_export_and_recalibrate_say_when_there_are_no_samples(tmp_path, capsys):
    import argparse

    from agent.cli.models import run_recalibrate, run_samples_export

    args = argparse.Namespace(config=None, state_dir=str(tmp_path), name="det", json=True,
                              out=str(tmp_path / "out"))
    for run in (run_samples_export, run_recalibrate):
        with pytest.raises(AgentError) as info:
            run(args)
        assert info.value.code == "no_samples" and "det" in info.value.message
    store = SampleStore(str(tmp_path / "samples"))
    os.makedirs(store.dir("det"))
    np.savez(os.path.join(store.dir("det"), "000000000001-130.npz"),
             input=np.zeros((130, 4), np.float32))
    assert run_recalibrate(args) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["samples"] == 130 and made["shards"] == ["shard_000.npz", "shard_001.npz",
                                                         "shard_002.npz"]
    assert np.load(os.path.join(made["dir"], "shard_002.npz"))["input"].shape == (2, 4)


def test_the_last_field_figures_come_back_after_a_restart(tmp_path):
    from agent.device.config import Config
    from agent.device.models.directory import ModelsDir
    from agent.device.models.live_check import LiveCheck

    models = ModelsDir(str(tmp_path / "models"))
    os.makedirs(models.version_dir("det", "v2"))
    open(os.path.join(models.version_dir("det", "v2"), "calibration.cache"), "w").close()
    live = LiveCheck(Config(state_dir=str(tmp_path)), models, lambda *event, **kw: None)
    figures = {"version": "v2", "stale": ["conv1"], "clip_max": 0.2, "max_clip_rate": 0.01,
               "samples": 64}
    live.samples.write_field("det", figures)
    live.next_field = 0.0
    live.tick(lambda: [{"name": "det", "version": "v2", "precision": "int8"}])
    assert live.problem("det", "v2").startswith("calibration_stale: 20.0% of activations")
    assert live.problem("det", "v3") is None  # figures of another version say nothing
    assert live.telemetry() == {"int8_clip_rate.det": 0.2}
    live.on_field("det", dict(figures, stale=[], drifted=["image"], max_drift=0.25,
                              inputs={"image": {"drift": {"hist_distance": 0.41}}}))
    assert live.problem("det", "v2") == "calibration_stale: inputs drifted from the " \
        "calibration set (histogram distance beyond 0.25) in image 0.41"
    assert live.summary("det")["drifted"] == ["image"]
    assert live.telemetry() == {"int8_clip_rate.det": 0.2, "int8_input_drift.det": 0.41}
    live.on_field("det", dict(figures, stale=[], drifted=[]))  # back within both: cleared
    assert live.problem("det", "v2") is None
    live.forget("det")
    assert live.problem("det") is None and not os.path.exists(live.samples.dir("det"))


def test_a_live_check_recorded_in_meta_json_is_read_back_only_when_whole(tmp_path):
    """After a restart a pending version takes its live check's recorded end back; anything
    else (nothing recorded, a damaged record) makes the check run again."""
    from agent.device.config import Config
    from agent.device.models.directory import ModelsDir
    from agent.device.models.live_check import LiveCheck

    models = ModelsDir(str(tmp_path / "models"))
    folder = models.version_dir("det", "v2")
    os.makedirs(folder)
    live = LiveCheck(Config(state_dir=str(tmp_path)), models, lambda *event, **kw: None)

    def meta(live_check):
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump({"name": "det"} if live_check is None else
                      {"name": "det", "live_check": live_check}, f)
        return live.recorded("det", "v2")

    assert live.recorded("det", "v2") is None  # no meta.json at all
    assert meta(None) is None
    assert meta({"skipped": "0 donated samples"}) == {"skipped": "0 donated samples"}
    refused = {"passed": False, "samples": 64, "agreement": 0.1, "error": 0.5,
               "error_stat": "mean", "min_agreement": 0.95, "max_error": None, "worst": [3],
               "running": "v1"}
    assert meta(refused) == refused
    assert meta(dict(refused, passed="no")) is None
    assert meta({k: v for k, v in refused.items() if k != "worst"}) is None
