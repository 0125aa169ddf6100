"""Engine cache build locks: two processes build one key once, a lock timeout, re-entry."""

import multiprocessing
import os
import time

import pytest

from agent.engines import cache_lock
from agent.engines.cache import EngineCache
from agent.errors import AgentError
from tests.unit.engines.test_engine_cache import _hex

# --- two processes, one build --------------------------------------------------------------


def _build_once(root, key, marker_dir, barrier):
    """What engine.build_engine does: check, lock, re-check, build, publish."""
    cache = EngineCache(root)
    barrier.wait()
    if cache.get(key) is not None:
        return
    with cache.lock(key):
        if cache.get(key) is not None:
            return
        with open(os.path.join(marker_dir, "build-{}".format(os.getpid())), "w"):
            pass
        with cache.staging(key) as stage:
            time.sleep(0.5)  # a slow build: the other process must wait, not build
            with open(stage.engine_path, "wb") as f:
                f.write(b"built")
            cache.publish(stage, {})


def in_two_processes(ctx, target, args, timeout):
    """Run ``target(*args, barrier)`` in two processes that pass the barrier together; both
    must exit cleanly."""
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=target, args=args + (barrier,)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0


def test_two_processes_build_the_same_key_once(tmp_path):
    root, markers = str(tmp_path / "engines"), tmp_path / "markers"
    markers.mkdir()
    key = _hex(60)
    in_two_processes(multiprocessing.get_context("fork"), _build_once, (root, key, str(markers)),
                     30)
    assert len(os.listdir(str(markers))) == 1
    assert EngineCache(root).get(key) is not None


def test_lock_timeout_gives_cache_locked(tmp_path):
    root = str(tmp_path)
    key = _hex(61)
    ctx = multiprocessing.get_context("fork")
    held, release = ctx.Event(), ctx.Event()

    def hold():
        with EngineCache(root).lock(key):
            held.set()
            release.wait(10)

    p = ctx.Process(target=hold)
    p.start()
    try:
        assert held.wait(10)
        with pytest.raises(AgentError) as err:
            with EngineCache(root, lock_timeout=0.1).lock(key):
                pass
        assert err.value.code == "cache_locked"
    finally:
        release.set()
        p.join(10)
    with EngineCache(root, lock_timeout=1).lock(key):
        pass


def test_lock_is_reentrant_in_one_process(tmp_path):
    cache = EngineCache(str(tmp_path))
    key = _hex(62)
    with cache.lock(key):
        with cache.lock(key, timeout=0):
            pass
    assert cache_lock._HELD == {}
