"""systemd/jetson-agent.service: `systemd-analyze verify` accepts it (and each example drop-in)
without a warning, and it keeps the settings the daemon and GPU access depend on."""

import configparser
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
UNIT = os.path.join(ROOT, "systemd", "jetson-agent.service")
DROPINS = sorted(glob.glob(os.path.join(ROOT, "systemd", "jetson-agent.service.d",
                                        "*.conf.example")))
EXEC = "/opt/jetson-agent/venv/bin/jetson-agent"


def read_unit(extra=""):
    with open(UNIT) as f:
        return f.read() + extra


def settings(text):
    """section -> key -> list of values (systemd keys may repeat)."""
    out = {}
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(section, {}).setdefault(key, []).append(value)
    return out


def verify(tmp_path, text):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    true = shutil.which("true")
    path = tmp_path / "jetson-agent.service"
    path.write_text(text.replace(EXEC, true))
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                          text=True, timeout=60)
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines()
                  if str(path) in line]
    return proc.returncode, complaints


def test_unit_verifies(tmp_path):
    rc, complaints = verify(tmp_path, read_unit())
    assert rc == 0 and not complaints, complaints


@pytest.mark.parametrize("dropin", DROPINS, ids=os.path.basename)
def test_dropin_examples_verify(tmp_path, dropin):
    with open(dropin) as f:
        body = "\n".join(line for line in f.read().splitlines() if not line.startswith("#"))
    # A drop-in's [Service] lines appended after [Install] would land in the wrong section:
    # splice them in before [Install].
    unit = read_unit()
    head, install = unit.split("[Install]")
    rc, complaints = verify(tmp_path, head + body.replace("[Service]", "") + "\n[Install]"
                            + install)
    assert rc == 0 and not complaints, complaints


def test_verify_would_catch_a_typo(tmp_path):
    head, install = read_unit().split("[Install]")
    rc, complaints = verify(tmp_path, head + "ProtectSystm=strict\n[Install]" + install)
    assert complaints


def test_unit_settings():
    s = settings(read_unit())
    service = s["Service"]
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]
    assert int(service["WatchdogSec"][0]) > 0
    assert service["Restart"] == ["on-failure"]
    assert service["StateDirectory"] == ["jetson-agent"]
    assert service["CacheDirectory"] == ["jetson-agent"]
    assert service["User"] == ["jetson-agent"]
    assert set(service["SupplementaryGroups"][0].split()) >= {"jtop", "video", "render"}
    assert any(v.startswith("mqtt-password:") for v in service["LoadCredential"])
    assert service["ExecStart"][0].startswith(EXEC + " run --config ")
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables"):
        assert service[key] == ["yes"], key
    assert service["ProtectSystem"] == ["strict"]
    # GPU access: /dev/nvhost-* and /dev/nvmap must stay visible.
    assert "PrivateDevices" not in service
    assert "MemoryDenyWriteExecute" not in service
    # A memory ceiling for the service; an OOM kill of the worker must not stop the daemon.
    assert service["MemoryMax"][0].endswith("%") and service["OOMPolicy"] == ["continue"]
    assert s["Install"]["WantedBy"] == ["multi-user.target"]


def test_config_parser_reads_it():
    # A second, independent reader: the file is plain INI that any tool can parse.
    parser = configparser.RawConfigParser(strict=False)
    parser.optionxform = str
    parser.read(UNIT)
    assert parser.get("Service", "Type") == "notify"
