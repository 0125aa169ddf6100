"""Who reaches the app socket and the models under the shipped unit, the pure parts: the
socket's ACL (one entry per allowed uid and gid), names this system does not know refused
with bad_config, and the unit's paths as the config's defaults (the variables the unit sets
and the client library reads). The whole setup as it runs: tests/integration/
test_unit_app_access.py."""

import os
import shutil
import socket
import struct
import tempfile

import pytest

from agent.device.app import server as app_socket
from agent.device.app.requests import allowed_ids
from agent.device.config import Config
from agent.errors import AgentError


def entries(acl):
    assert struct.unpack("<I", acl[:4]) == (2,)
    return [struct.unpack("<HHI", acl[i:i + 8]) for i in range(4, len(acl), 8)]


def test_acl_names_each_uid_and_gid_read_write_and_nobody_else():
    got = entries(app_socket.acl_rw([1002, 1001, 1001], [3000]))
    no_id = 0xFFFFFFFF
    assert got == [(0x01, 6, no_id), (0x02, 6, 1001), (0x02, 6, 1002), (0x04, 6, no_id),
                   (0x08, 6, 3000), (0x10, 6, no_id), (0x20, 0, no_id)]


@pytest.mark.parametrize("users, group, key", [
    (["no-such-user-h32"], None, "models.app_users"),
    ([], "no-such-group-h32", "models.app_group"),
])
def test_unknown_names_stop_the_start_with_bad_config(users, group, key):
    with pytest.raises(AgentError) as info:
        allowed_ids(users, group)
    assert info.value.code == "bad_config" and key in info.value.message
    assert "no-such-" in info.value.message


def test_numeric_ids_need_no_entry():
    assert allowed_ids(["4242"], "4343") == ([4242], [4343])


def test_the_socket_gets_the_acl_where_the_file_system_has_acls():
    folder = tempfile.mkdtemp(prefix="appacl-", dir="/tmp")
    path = os.path.join(folder, "run", "app.sock")  # its folder is made when missing
    try:
        with app_socket.AppSocket(path, [54321], [54322], lambda r, p: {"ok": True}):
            try:
                acl = os.getxattr(path, "system.posix_acl_access")
            except OSError:
                mode = os.stat(path).st_mode & 0o777
                assert mode == 0o666  # no ACLs here: the peer check alone decides
                return
            assert (0x02, 6, 54321) in entries(acl)
            if os.stat(path).st_gid != 54322:  # not root: the group is an ACL entry instead
                assert (0x08, 6, 54322) in entries(acl)
            assert (0x20, 0, 0xFFFFFFFF) in entries(acl)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_units_paths_are_the_defaults(monkeypatch):
    cfg = Config(state_dir="/srv/state")
    monkeypatch.delenv("JETSON_AGENT_MODELS_DIR", raising=False)
    monkeypatch.delenv("JETSON_AGENT_SOCKET", raising=False)
    assert (cfg.models_dir, cfg.app_socket) == ("/srv/state/models", "/srv/state/app.sock")
    monkeypatch.setenv("JETSON_AGENT_MODELS_DIR", "/var/lib/jetson-agent-models")
    monkeypatch.setenv("JETSON_AGENT_SOCKET", "/run/jetson-agent/app.sock")
    assert (cfg.models_dir, cfg.app_socket) == ("/var/lib/jetson-agent-models",
                                                "/run/jetson-agent/app.sock")
    cfg.models.dir, cfg.models.socket = "/data/models", "/data/app.sock"
    assert (cfg.models_dir, cfg.app_socket) == ("/data/models", "/data/app.sock")


def test_handoff_paths_the_daemon_writes():
    from agent.device.writable_paths import handoff_paths

    entries = [{"type": "triton", "repository": "/var/lib/triton/models"},
               {"type": "deepstream", "config": "/opt/myapp/infer.txt",
                "override": "/opt/app2/over.txt"},
               {"type": "command", "command": ["true"]}, "junk"]
    assert handoff_paths(entries) == [("handoff[0].repository", "/var/lib/triton/models"),
                                      ("handoff[1].config", "/opt/myapp"),
                                      ("handoff[1].override", "/opt/app2")]
    assert handoff_paths(None) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="checking as another uid needs root (setuid)")
def test_a_path_the_service_cannot_write_is_named_with_the_drop_in(tmp_path):
    from agent.device.writable_paths import problems

    folder = tempfile.mkdtemp(prefix="rw-", dir="/tmp")
    os.chmod(folder, 0o755)  # root's: another uid may not write there
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            found = problems("/tmp/models-h32", [{"type": "triton",
                                                  "repository": folder + "/repo/x"}])
            os.write(write, "\n".join(found).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        text = f.read().decode()
    os.waitpid(pid, 0)
    shutil.rmtree(folder, ignore_errors=True)
    assert text.count("\n") == 0 and text.startswith("handoff[0].repository " + folder)
    assert "ReadWritePaths=" in text and "not writable by uid 65534" in text
