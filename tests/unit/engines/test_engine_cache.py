"""Engine cache: keys, atomic entries, verification, LRU budget, full disk (build locks:
test_engine_cache_locks.py; build_engine through the cache: test_build_engine.py)."""

import errno
import json
import os

import pytest

from agent.engines.backends.base import BuildPlan, CalibrationSettings
from agent.engines.cache import EngineCache
from agent.engines.cache_key import cache_key, sorted_json
from agent.engines.cache_upkeep import engine_loader
from agent.errors import AgentError
from tests import models

BACKEND = {"backend": "onnxruntime", "version": "1.0"}
PLATFORM = {"soc": "host", "arch": "x86_64"}


def _key(**overrides):
    args = dict(model_digest="m" * 64, plan=BuildPlan("int8", calibration=CalibrationSettings(
        data="/data/a", cache="/x/calib.cache")), calibration_digest="d1",
        backend_fingerprint=BACKEND, platform_fingerprint=PLATFORM)
    args.update(overrides)
    return cache_key(**args)


# --- keys ----------------------------------------------------------------------------------

def test_key_bytes_never_change():
    """Golden values: a change here orphans every cached engine in the field."""
    assert sorted_json({"b": [1, 2.5, None], "a": "\u00e9", "c": {"z": 1, "y": "object"}}) == \
        b'{"a":"\\u00e9","b":[1,2.5,null],"c":{"y":"object","z":1}}'
    plan = {"precision": "fp16", "calibration": {"data": "/x", "cache": "/y", "algo": "minmax"},
            "plugins": [{"sha256": "p2"}, {"sha256": "p1"}]}
    assert cache_key("sha256:ab", plan, "cd", {"trt": "10.3"}, {"sm": "87"}) == \
        "38588d50067eb2b6a28f33304321320fe22294ab36718665ee1547c903e7bec7"


def test_key_is_stable_and_ignores_calibration_paths():
    base = _key()
    assert base == _key()
    assert len(base) == 64
    moved = BuildPlan("int8", calibration=CalibrationSettings(data="/elsewhere/a",
                                                               cache="/y/other.cache"))
    assert _key(plan=moved) == base
    assert _key(plan=moved.to_dict()) == base  # a dict plan works the same


@pytest.mark.parametrize("change", [
    {"model_digest": "n" * 64},
    {"plan": BuildPlan("int8", layer_precisions={"fc0": "float32"},
                       calibration=CalibrationSettings(data="/data/a"))},
    {"plan": BuildPlan("int8", calibration=CalibrationSettings(data="/data/a",
                                                               algorithm="minmax"))},
    {"plan": BuildPlan("int8", mark_outputs=["*"],
                       calibration=CalibrationSettings(data="/data/a"))},
    {"calibration_digest": "d2"},
    {"backend_fingerprint": {"backend": "onnxruntime", "version": "1.1"}},
    {"platform_fingerprint": {"soc": "tegra234", "arch": "aarch64"}},
])
def test_key_changes_with_what_the_engine_depends_on(change):
    assert _key(**change) != _key()


# --- entries -------------------------------------------------------------------------------

def _put(cache, key, data=b"engine-bytes", **info):
    src = os.path.join(cache.root, "src-" + key[:8])
    with open(src, "wb") as f:
        f.write(data)
    try:
        return cache.put(key, src, info)
    finally:
        os.unlink(src)


def _hex(i):
    return "{:064x}".format(i)


def test_put_get_layout_and_meta(tmp_path):
    cache = EngineCache(str(tmp_path / "engines"))
    key = _hex(0xabc)
    entry = _put(cache, key, b"x" * 100, plan={"precision": "fp16"})
    assert entry.path == os.path.join(cache.root, key[:2], key)
    assert open(entry.engine_path, "rb").read() == b"x" * 100
    meta = json.load(open(os.path.join(entry.path, "meta.json")))
    assert meta["key"] == key and meta["bytes"] == 100
    assert meta["files"]["engine"]["bytes"] == 100
    assert meta["plan"] == {"precision": "fp16"}
    got = cache.get(key)
    assert got is not None and got.engine_path == entry.engine_path
    assert cache.get(_hex(0xabd)) is None
    assert os.listdir(os.path.join(cache.root, "tmp")) == []  # staging cleaned
    assert [e.key for e in cache.ls()] == [key]


def test_default_root_is_under_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JETSON_AGENT_STATE_DIR", str(tmp_path / "s"))
    assert EngineCache().root == str(tmp_path / "s" / "engines")


def test_bad_key_is_rejected(tmp_path):
    with pytest.raises(AgentError) as err:
        EngineCache(str(tmp_path)).get("../etc")
    assert err.value.code == "bad_argument"


@pytest.mark.parametrize("damage", ["flip", "truncate", "meta", "missing"])
def test_corrupt_entry_is_detected_dropped_and_counted(tmp_path, damage):
    cache = EngineCache(str(tmp_path))
    key = _hex(1)
    entry = _put(cache, key, b"a" * 64)
    if damage == "flip":
        with open(entry.engine_path, "r+b") as f:
            f.seek(10)
            f.write(b"b")
    elif damage == "truncate":
        with open(entry.engine_path, "r+b") as f:
            f.truncate(20)
    elif damage == "meta":
        with open(os.path.join(entry.path, "meta.json"), "w") as f:
            f.write("{not json")
    else:
        os.unlink(entry.engine_path)
    assert cache.get(key) is None
    assert not os.path.exists(entry.path)
    assert cache.stats()["corrupt"] == 1
    _put(cache, key, b"a" * 64)  # the rebuild publishes cleanly
    assert cache.get(key) is not None


def test_verify_reports_and_drops_corrupt_entries(tmp_path):
    cache = EngineCache(str(tmp_path))
    good, bad = _hex(2), _hex(3)
    _put(cache, good)
    entry = _put(cache, bad)
    with open(entry.engine_path, "ab") as f:
        f.write(b"!")
    os.makedirs(os.path.join(cache.root, "tmp", _hex(9) + ".deadbeef"))  # a crashed build
    report = cache.verify()
    assert report["checked"] == 2 and report["ok"] == 1 and report["dropped"] == 1
    assert report["corrupt"][0]["key"] == bad and "bytes" in report["corrupt"][0]["problem"]
    assert report["stale_staging_removed"] == 1
    assert [e.key for e in cache.ls()] == [good]


def test_verify_with_a_loader_drops_engines_that_do_not_load(tmp_path):
    # Intact bytes (digests match) that the backend named in meta.json cannot open; an entry
    # of a backend that is not importable here is checked by its digests only.
    cache = EngineCache(str(tmp_path))
    ort_info = {"fingerprints": {"backend": {"backend": "onnxruntime"}}}
    bad = _put(cache, _hex(4), b"not an onnx model", **ort_info)
    model = models.fp16_max_model().SerializeToString()
    _put(cache, _hex(5), model, **ort_info)
    _put(cache, _hex(6), b"opaque", fingerprints={"backend": {"backend": "tensorrt"}})
    report = cache.verify(load=engine_loader())
    assert report["checked"] == 3 and report["ok"] == 2
    assert [c["key"] for c in report["corrupt"]] == [bad.key]
    assert "does not load" in report["corrupt"][0]["problem"]


class Clock(object):
    def __init__(self):
        self.now = 1000000.0

    def __call__(self):
        self.now += 1.0
        return self.now


def test_lru_eviction_to_budget(tmp_path):
    cache = EngineCache(str(tmp_path), budget_bytes=2500, clock=Clock())
    keys = [_hex(10 + i) for i in range(3)]
    for key in keys:
        _put(cache, key, b"z" * 1000)
    # the third publish went over budget: the least recently used (first) entry is gone
    assert sorted(e.key for e in cache.ls()) == sorted(keys[1:])
    cache.get(keys[1])  # use the older survivor: now keys[2] is least recently used
    _put(cache, _hex(20), b"z" * 1000)
    assert sorted(e.key for e in cache.ls()) == sorted([keys[1], _hex(20)])
    assert cache.stats()["evicted"] == 2
    assert cache.stats()["bytes"] <= 2500


def test_eviction_never_drops_the_new_entry_or_one_in_use(tmp_path):
    cache = EngineCache(str(tmp_path), budget_bytes=100, clock=Clock())
    old = _hex(30)
    _put(cache, old, b"o" * 80)
    with cache.pin(old) as pinned:
        assert pinned is not None
        new = _put(cache, _hex(31), b"n" * 80)  # over budget, but old is in use
        assert {e.key for e in cache.ls()} == {old, new.key}
    huge = _put(cache, _hex(32), b"h" * 500)  # larger than the budget: still kept
    assert [e.key for e in cache.ls()] == [huge.key]


def test_purge_all_key_and_older_than(tmp_path):
    clock = Clock()
    cache = EngineCache(str(tmp_path), clock=clock)
    a, b, c = _hex(40), _hex(41), _hex(42)
    _put(cache, a)
    clock.now += 10 * 86400
    _put(cache, b)
    _put(cache, c)
    assert cache.purge(older_than_days=5)["removed"] == [a]
    assert cache.purge(key=b)["removed"] == [b]
    with pytest.raises(AgentError) as err:
        cache.purge(key=b)
    assert err.value.code == "bad_argument"
    with cache.pin(c):
        assert cache.purge(everything=True) == {"removed": [], "skipped_in_use": [c],
                                                "kept_protected": [], "forced_protected": []}
    assert cache.purge(everything=True)["removed"] == [c]
    assert cache.ls() == []
    with pytest.raises(AgentError):
        cache.purge()


# --- full disk -----------------------------------------------------------------------------

def _fail_writes_after(monkeypatch, allowed_bytes):
    """ENOSPC from os.write once ``allowed_bytes`` have been written (the disk boundary)."""
    real_write = os.write
    budget = [allowed_bytes]

    def write(fd, data):
        if len(data) > budget[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget[0] -= len(data)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_full_disk_at_fsync_leaves_no_partial_entry(tmp_path, monkeypatch):
    cache = EngineCache(str(tmp_path))
    src = str(tmp_path / "engine.src")
    with open(src, "wb") as f:
        f.write(b"e" * 100)

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(AgentError) as err:
        cache.put(_hex(51), src)
    monkeypatch.undo()
    assert err.value.code == "disk_full"
    assert cache.ls() == [] and os.listdir(os.path.join(cache.root, "tmp")) == []


@pytest.mark.parametrize("allowed", [0, 5000])  # fails in the engine copy / in meta.json
def test_full_disk_leaves_no_partial_entry(tmp_path, monkeypatch, allowed):
    cache = EngineCache(str(tmp_path))
    key = _hex(50)
    src = str(tmp_path / "engine.src")
    with open(src, "wb") as f:
        f.write(b"e" * 5000)
    _fail_writes_after(monkeypatch, allowed)
    with pytest.raises(AgentError) as err:
        cache.put(key, src, {"plan": {}})
    monkeypatch.undo()
    assert err.value.code == "disk_full"
    assert "no space" in err.value.message
    assert cache.get(key) is None
    assert not os.path.exists(cache.entry_dir(key))
    assert os.listdir(os.path.join(cache.root, "tmp")) == []
