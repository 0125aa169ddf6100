"""The engine cache keeps what the models directory uses: eviction skips protected entries and
counts them outside the budget (reported when they alone exceed it), purge keeps and names them
(``force`` removes them with a warning), an engine hard-linked from outside is protected on its
own; and the files it publishes are readable by the service's group."""

import contextlib
import os
import shutil
import stat
import tempfile

import pytest

from agent import fsio
from agent.device.models import guard as models_guard
from agent.engines.cache import EngineCache
from tests.models_dir import add_version


def _hex(i):
    return "{:064x}".format(i)


class Clock(object):
    def __init__(self):
        self.now = 1000000.0

    def __call__(self):
        self.now += 1.0
        return self.now


def _put(cache, key, size):
    src = os.path.join(cache.root, "src-" + key[:8])
    with open(src, "wb") as f:
        f.write(b"e" * size)
    try:
        return cache.put(key, src, {})
    finally:
        os.unlink(src)


@pytest.fixture
def setup(tmp_path):
    """A cache with two active versions of a name and its rollback target, all copies (as on
    another file system: only the models directory's meta.json says they are in use)."""
    models = tmp_path / "models"
    cache = EngineCache(str(tmp_path / "engines"), clock=Clock(),
                        protected=models_guard.protection(str(models)))
    v1, v2, other = (_put(cache, _hex(i), 1000) for i in (1, 2, 3))
    add_version(models, "detector", "v1", v1.engine_path, v1.key, link=False)
    add_version(models, "detector", "v2", v2.engine_path, v2.key, link=False, current=True)
    add_version(models, "tiny", "a1", other.engine_path, other.key, link=False, current=True)
    return cache, models, [v1.key, v2.key, other.key]


def test_a_tiny_budget_evicts_only_what_nothing_uses(setup):
    cache, _models, protected = setup
    old = _put(cache, _hex(10), 500).key
    cache.budget_bytes = 2000  # less than the 3000 bytes the versions use
    new = _put(cache, _hex(11), 1000).key  # 1500 bytes unprotected: nothing to evict
    assert {e.key for e in cache.ls()} == set(protected) | {old, new}
    assert cache.budget_report["evicted"] == [] and cache.budget_report["bytes"] == 1500
    newest = _put(cache, _hex(12), 1000).key  # 2500 unprotected: the oldest unused goes
    assert {e.key for e in cache.ls()} == set(protected) | {new, newest}
    report = cache.budget_report
    assert report["evicted"] == [old] and report["bytes"] == 2000
    assert report["protected_bytes"] == 3000 and report["protected_over_budget"]
    assert sorted(u for p in report["protected"] for u in p["users"]) == [
        "detector@v1 (kept)", "detector@v2 (current)", "tiny@a1 (current)"]
    stats = cache.stats()
    assert stats["protected_entries"] == 3 and stats["protected_bytes"] == 3000


def test_a_budget_of_zero_keeps_the_protected_and_the_new_entry(setup):
    cache, _models, protected = setup
    cache.budget_bytes = 0
    new = _put(cache, _hex(20), 100).key
    assert {e.key for e in cache.ls()} == set(protected) | {new}
    assert cache.evict() == [new]
    assert {e.key for e in cache.ls()} == set(protected)


def test_purge_keeps_the_protected_and_says_why_force_removes(setup, caplog):
    cache, models, protected = setup
    spare = _put(cache, _hex(30), 10).key
    out = cache.purge(everything=True)
    assert out["removed"] == [spare] and out["forced_protected"] == []
    kept = {k["key"]: k["users"] for k in out["kept_protected"]}
    assert kept == {protected[0]: ["detector@v1 (kept)"],
                    protected[1]: ["detector@v2 (current)"], protected[2]: ["tiny@a1 (current)"]}
    assert cache.purge(key=protected[1])["removed"] == []
    assert cache.purge(older_than_days=0)["removed"] == []
    with caplog.at_level("WARNING"):
        out = cache.purge(everything=True, force=True)
    assert sorted(out["removed"]) == sorted(protected) and len(out["forced_protected"]) == 3
    assert "detector@v2 (current)" in caplog.text and "--force" in caplog.text
    assert cache.ls() == []
    # the copies in the models directory are untouched; the health check sees them whole
    assert models_guard.check_models(str(models), verify=True) == []


def test_an_engine_hard_linked_from_outside_is_protected_without_being_named(tmp_path):
    cache = EngineCache(str(tmp_path / "engines"), budget_bytes=0, clock=Clock())
    linked = _put(cache, _hex(40), 100)
    os.link(linked.engine_path, str(tmp_path / "app.engine"))
    other = _put(cache, _hex(41), 100).key
    assert {e.key for e in cache.ls()} == {linked.key, other}
    out = cache.purge(everything=True)
    assert out["removed"] == [other]
    assert out["kept_protected"][0]["users"] == ["1 hard link outside the cache"]


def test_eviction_stops_when_it_cannot_tell_what_is_in_use(tmp_path):
    def broken():
        raise OSError(13, "Permission denied")
    cache = EngineCache(str(tmp_path), budget_bytes=0, clock=Clock(), protected=broken)
    a = _put(cache, _hex(50), 10).key
    b = _put(cache, _hex(51), 10).key
    assert {e.key for e in cache.ls()} == {a, b}
    assert "Permission denied" in cache.budget_report["error"]


# --- permissions ---------------------------------------------------------------------------

@contextlib.contextmanager
def umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_published_files_follow_the_services_umask(tmp_path):
    # The backends write engines through temporary files (0600); the service's UMask=0027
    # promises its group can read them (docs/daemon.md).
    with umask(0o027):
        assert fsio.current_umask() == 0o027
        cache = EngineCache(str(tmp_path / "engines"))
        entry = _put(cache, _hex(60), 10)
        fsio.atomic_write(str(tmp_path / "x"), b"x", mode=0o644)
        fsio.atomic_write(str(tmp_path / "y"), b"y")
    assert _mode(str(tmp_path / "x")) == 0o640 and _mode(str(tmp_path / "y")) == 0o600
    for name in ("engine", "meta.json", "last_used"):
        assert _mode(os.path.join(entry.path, name)) == 0o640, name
    assert _mode(entry.path) == 0o750


def test_a_configured_group_gets_0640_files_and_0750_directories(tmp_path):
    gid = os.getgid()
    with umask(0o077):  # even under a stricter umask
        cache = EngineCache(str(tmp_path / "engines"), group=gid)
        entry = _put(cache, _hex(61), 10)
    for name in ("engine", "meta.json"):
        st = os.stat(os.path.join(entry.path, name))
        assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == gid
    assert _mode(entry.path) == 0o750 and os.stat(entry.path).st_gid == gid


def _read_as(uid, gid, groups, path):
    """Exit status of a forked child that drops to uid/gid/groups and reads ``path``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            with open(path, "rb") as f:
                f.read(1)
            code = 0
        except PermissionError:
            code = 1
        finally:
            os._exit(code)
    _pid, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if hasattr(os, "waitstatus_to_exitcode") \
        else status >> 8


@pytest.mark.skipif(os.geteuid() != 0, reason="reading as another uid needs root to setuid "
                    "a forked child")
def test_an_app_user_in_the_group_reads_the_deployed_engine():
    app_group, app_uid, stranger_uid = 54321, 54322, 54323  # no /etc entries needed
    top = tempfile.mkdtemp(prefix="cache21-perm-")
    try:
        os.chmod(top, 0o755)  # the path down to it is searchable by anyone (/tmp)
        with umask(0o027):
            cache = EngineCache(os.path.join(top, "engines"), group=app_group)
            entry = _put(cache, _hex(62), 10)
            models = os.path.join(top, "models")
            version = add_version(models, "detector", "v1", entry.engine_path, entry.key,
                                  current=True)
        os.chmod(models, 0o755)
        for d in (os.path.join(models, "detector"), version):
            os.chown(d, -1, app_group)
            os.chmod(d, 0o750)
        deployed = os.path.join(models, "detector", "current", "model.engine")
        assert _read_as(app_uid, app_group, [app_group], deployed) == 0
        assert _read_as(stranger_uid, stranger_uid, [], deployed) == 1
        # the cache entry itself, through 0750 directories of the group
        os.chmod(cache.root, 0o755)
        os.chmod(os.path.dirname(entry.path), 0o755)
        assert _read_as(app_uid, 54999, [app_group], entry.engine_path) == 0
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_worker_job_keeps_the_engines_its_spec_names(setup, tmp_path):
    # The daemon puts models_guard.worker_spec_fields into the job spec (JSON) it hands the
    # worker, which cannot read the models directory's rules itself.
    import json

    from agent.worker.context import protected_from_spec

    cache, models, protected = setup
    spec = json.loads(json.dumps(models_guard.worker_spec_fields(str(models), group="0")))
    assert spec["engine_group"] == "0"
    worker_cache = EngineCache(cache.root, budget_bytes=0, clock=Clock(),
                               protected=protected_from_spec(spec),
                               group=spec["engine_group"])
    new = _put(worker_cache, _hex(70), 10).key
    assert {e.key for e in worker_cache.ls()} == set(protected) | {new}
    assert protected_from_spec({"protected_engines": [protected[0]]})() == {protected[0]: []}
    assert protected_from_spec({})() == {}


def test_the_models_directory_is_found_like_the_daemon_finds_it():
    from types import SimpleNamespace

    from agent.cli.models_location import models_dir, models_group

    args = SimpleNamespace(models_dir=None)
    assert models_dir(args, "/s") == "/s/models"
    assert models_dir(args, "/s", SimpleNamespace()) == "/s/models"  # a config without models
    cfg = SimpleNamespace(models=SimpleNamespace(dir="/m", group="app"))
    assert models_dir(args, "/s", cfg) == "/m" and models_group(cfg) == "app"
    assert models_dir(args, "/s", SimpleNamespace(models={"dir": "/d"})) == "/d"
    assert models_dir(SimpleNamespace(models_dir="/x"), "/s", cfg) == "/x"
    assert models_group(SimpleNamespace(models=SimpleNamespace(dir=None))) is None
