"""The demo end to end (what ./scripts/demo runs once the venv and Mosquitto are there): both
devices SUCCEEDED in both rollouts, the classifier's int8 accuracy next to fp32, the FP16_MAX
model's kept layers, the example app taking digits v1 and v2 and refusing the broken v3 (rolled
back on every device, no request failed), and nothing left running afterwards."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.integration.conftest import MOSQUITTO

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def processes_mentioning(text):
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/{}/cmdline".format(pid), "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if text in cmdline:
            found.append((pid, cmdline))
    return found


def table_rows(out, header_start="DEVICE    BOARD"):
    """The device rows of every results table in the output, per table."""
    tables, current = [], None
    for line in out.splitlines():
        if line.startswith(header_start):
            current = []
            tables.append(current)
        elif current is not None and line.startswith("jetson-"):
            current.append(line)
        else:
            current = None
    return tables


@pytest.mark.slow
def test_demo_rolls_out_both_examples_and_cleans_up():
    if not os.path.exists(MOSQUITTO):
        pytest.skip("mosquitto is not installed")
    env = dict(os.environ)
    env.pop("JETSON_AGENT_STATE_DIR", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "lib", "demo.py")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=170)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "demo: OK: every device SUCCEEDED in both rollouts" in out

    tables = table_rows(out)
    # The example app's part: three more rollouts (digits v1, v2, and the broken v3).
    assert "The app on each device" in out
    assert len(tables) == 5, out
    digits, fp16 = tables[:2]
    for rows in tables[:2]:
        assert [r.split()[0] for r in rows] == ["jetson-a", "jetson-b"], rows
        assert all(" SUCCEEDED " in r for r in rows), rows
    for row in digits:
        assert " int8* " in row
        acc = re.search(r"acc (\d+\.\d)% \(fp32 (\d+\.\d)%\), top-1 (\d+\.\d)%, pass", row)
        assert acc, row
        assert float(acc.group(1)) > 90 and float(acc.group(2)) > 90
    for row in fp16:
        assert " fp16* " in row and " Add,Sub:fp32 " in row, row
    assert "rollout digits-" in out and "rollout fp16_max-" in out
    # v3 passed the agent's gate, the app reported it unhealthy, each device rolled it back.
    for row in tables[4]:
        assert " FAILED " in row and "handoff_rolled_back" in row, row
    assert "digits@v3 was rolled back to v2: the app reported it unhealthy" in out
    # Each device back on v2 after the broken v3, no request failed during the switches.
    app_table = out.split("The app on each device")[1].split("\n\n")[0]
    app_rows = [line.split() for line in app_table.splitlines() if line.startswith("jetson-")]
    assert [r[:3] for r in app_rows] == [["jetson-a", "digits@v2", "v2"],
                                         ["jetson-b", "digits@v2", "v2"]], out
    assert all(r[-2] == "0" and r[-1] == "v3" for r in app_rows), out

    # The last fleet devices lists every model each device holds, with its state.
    devices_table = out.split("The app on each device")[1].split("\n\n")[1]
    assert devices_table.count("digits@v2 (committed)") == 2, devices_table

    # Message sizes were measured.
    assert re.search(r"^block\s+\d+", out, re.M) and re.search(r"^job_status\s+\d+", out, re.M)

    # Nothing left running: no process mentions the work directory, the broker port is free.
    workdir = re.search(r"work dir (\S+)\)", out).group(1)
    assert processes_mentioning(workdir) == []
    assert not os.path.exists(workdir)
    port = int(re.search(r"Mosquitto on mqtt://127\.0\.0\.1:(\d+)", out).group(1))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.mark.slow
def test_demo_stops_everything_on_ctrl_c():
    if not os.path.exists(MOSQUITTO):
        pytest.skip("mosquitto is not installed")
    env = dict(os.environ)
    env.pop("JETSON_AGENT_STATE_DIR", None)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "lib", "demo.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=env, start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 90
        command_seen = False
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            command_seen = command_seen or line.startswith("$ jetson-agent fleet rollout")
            # The rollout's own first line: it is recorded and under way.
            if command_seen and re.match(r"rollout \S+: .* device\(s\) in ", line):
                break
        else:
            raise AssertionError("no rollout under way in 90 s\n" + "".join(lines))
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    out = "".join(lines) + rest
    assert proc.returncode == 130, out
    assert "demo: interrupted; stopping everything" in out
    workdir = re.search(r"work dir (\S+)\)", out).group(1)
    assert processes_mentioning(workdir) == [], out
    assert not os.path.exists(workdir)
