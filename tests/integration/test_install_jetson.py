"""scripts/install-jetson: one recipe per JetPack, checked with ``--dry-run`` against the
recorded JetPack root trees (the unit it would install, its paths, the requirement sets);
the unit's ``systemd-analyze security`` exposure; journal lines with syslog priorities."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "install-jetson")
PLATFORMS = os.path.join(ROOT, "tests", "fixtures", "platforms")
UNIT = os.path.join(ROOT, "systemd", "jetson-agent.service")
PREFIX = "/srv/jetson-agent"
EXPOSURE_BEFORE = 5.6  # the unit's score when issue 15 was filed

# recorded tree -> (JetPack, systemd of its Ubuntu, daemon requirements, worker requirements)
RECIPES = {
    "nano": ("4.6", 237, "requirements.txt", "requirements-jetson4.txt"),
    "agx-xavier": ("5.x", 245, "requirements-jetson5.txt", ""),
    "orin-nano": ("6.x", 249, "requirements-jetson.txt", ""),
    "thor": ("7.x", 255, "requirements-jetson.txt", ""),
}


def install(*args, expect=0):
    proc = subprocess.run(["bash", SCRIPT] + [str(a) for a in args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


def recipe(stdout):
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)


def active(text):
    """Non-comment lines of a unit or drop-in, as (key, value)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.append((key, value))
    return out


@pytest.mark.parametrize("tree", sorted(RECIPES))
def test_dry_run_recipe_per_jetpack(tmp_path, tree):
    jetpack, systemd, req, req_worker = RECIPES[tree]
    stage = tmp_path / "stage"
    proc = install("--root", os.path.join(PLATFORMS, tree), "--prefix", PREFIX, "--stage", stage)
    r = recipe(proc.stdout)
    assert (r["JETPACK"], int(r["SYSTEMD"])) == (jetpack, systemd)
    assert r["DAEMON_REQUIREMENTS"] == req and r["WORKER_REQUIREMENTS"] == req_worker
    for name in filter(None, (req, req_worker)):
        assert os.path.isfile(os.path.join(ROOT, name)), name
    commands = [line[2:] for line in proc.stderr.splitlines() if line.startswith("+ ")]
    venv_pip = "{}/venv/bin/python -m pip --disable-pip-version-check".format(PREFIX)
    constraints = " -c {}/constraints-jetson4.txt".format(ROOT) if jetpack == "4.6" else ""
    assert "{} install -r {}/{}{}".format(venv_pip, ROOT, req, constraints) in commands
    assert "{} install --no-deps {}".format(venv_pip, ROOT) in commands
    assert any(c.endswith("ln -sfn {}/venv/bin/jetson-agent /usr/local/bin/jetson-agent".format(
        PREFIX)) for c in commands)  # `jetson-agent` is on PATH afterwards

    unit_path = stage / "etc/systemd/system/jetson-agent.service"
    unit = dict(active(unit_path.read_text()))
    assert unit["ExecStart"] == "{}/venv/bin/jetson-agent run --config " \
                                "/etc/jetson-agent/config.yaml".format(PREFIX)
    assert unit["Documentation"] == "file://{}/docs/daemon.md".format(PREFIX)
    dropins = stage / "etc/systemd/system/jetson-agent.service.d"
    credentials = dropins / "credentials.conf"
    if systemd < 247:  # no LoadCredential= there: the fallback drop-in, and no warnings
        assert "LoadCredential" not in unit and "ProtectProc" not in unit
        assert ("Environment", "CREDENTIALS_DIRECTORY=/etc/jetson-agent/credentials") in \
            active(credentials.read_text())
        assert r["CREDENTIALS"] == "CREDENTIALS_DIRECTORY=/etc/jetson-agent/credentials"
        assert any(c.endswith("install -d -m 0750 -g jetson-agent /etc/jetson-agent/credentials")
                   for c in commands)
    else:
        assert unit["LoadCredential"].startswith("mqtt-password:") and not credentials.exists()
    if jetpack == "4.6":
        worker = "{}/worker-py36/bin/python3".format(PREFIX)
        assert r["DAEMON_PYTHON"] == "python3.8" and r["WORKER_PYTHON"] == worker
        assert "python3.8 -m venv {}/venv".format(PREFIX) in commands
        assert "/usr/bin/python3 -m venv --system-site-packages {}/worker-py36".format(
            PREFIX) in commands
        assert "{} -m pip --disable-pip-version-check install -r {}/{}".format(
            worker, ROOT, req_worker) in commands
        assert ("Environment", "JETSON_AGENT_WORKER_PYTHON=" + worker) in \
            active((dropins / "jetpack46.conf").read_text())
    else:
        assert r["WORKER_PYTHON"] == "" and not (dropins / "jetpack46.conf").exists()
        assert "python3 -m venv --system-site-packages {}/venv".format(PREFIX) in commands
    if shutil.which("systemd-analyze"):
        checked = tmp_path / "jetson-agent.service"
        checked.write_text(unit_path.read_text().replace(
            "{}/venv/bin/jetson-agent".format(PREFIX), shutil.which("true")))
        proc = subprocess.run(["systemd-analyze", "verify", str(checked)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0 and str(checked) not in proc.stdout + proc.stderr


def test_bad_invocations_are_refused_before_doing_anything(tmp_path):
    proc = install("--root", os.path.join(PLATFORMS, "dgpu"), expect=2)
    assert "does not look like a Jetson" in proc.stderr and "--force" in proc.stderr
    assert recipe(install("--root", os.path.join(PLATFORMS, "dgpu"), "--force",
                          "--no-service").stdout)["JETPACK"] == "none"
    proc = install("--root", os.path.join(PLATFORMS, "thor"), "--prefix", "relative", expect=2)
    assert "--prefix must be an absolute path" in proc.stderr
    proc = install("--stage", tmp_path, expect=2)
    assert "--stage goes with --dry-run" in proc.stderr
    assert "Recipes, by the L4T release" in install("--help").stdout


def _exposure(path):
    proc = subprocess.run(["systemd-analyze", "security", "--offline=true", str(path)],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "offline" in proc.stderr:
        pytest.skip("this systemd-analyze has no --offline")
    last = [line for line in proc.stdout.splitlines() if "Overall exposure level" in line][-1]
    return float(last.split(":")[1].split()[0])


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_exposure_score_is_below_the_old_one(tmp_path):
    assert _exposure(UNIT) < EXPOSURE_BEFORE
    for tree in RECIPES:  # also the units rendered for older systemd (fewer directives)
        stage = tmp_path / tree
        install("--root", os.path.join(PLATFORMS, tree), "--stage", stage)
        assert _exposure(stage / "etc/systemd/system/jetson-agent.service") < EXPOSURE_BEFORE


def test_journal_lines_carry_syslog_priorities(tmp_path):
    log = tmp_path / "stderr"
    model = os.path.join(ROOT, "examples", "fp16_max", "model.onnx")
    args = [sys.executable, "-m", "agent", "build", model, "--fp16", "--layer-precisions",
            "Add:fp32", "--state-dir", str(tmp_path / "state")]
    with open(str(log), "w") as f:
        st = os.fstat(f.fileno())
        env = dict(os.environ, PYTHONPATH=ROOT,
                   JOURNAL_STREAM="{}:{}".format(st.st_dev, st.st_ino))
        subprocess.run(args, stdout=subprocess.DEVNULL, stderr=f, env=env, cwd=ROOT,
                       timeout=120, check=True)
        subprocess.run(args[:4] + [str(tmp_path)], stdout=subprocess.DEVNULL, stderr=f, env=env,
                       cwd=ROOT, timeout=120)
    lines = log.read_text().splitlines()
    assert any(line.startswith("<4>WARNING agent.build: --layer-precisions") for line in lines)
    assert any(line.startswith("<3>error [file_not_found]") for line in lines), lines
    # A stream that is not the journal (a terminal, the worker's log file) stays plain.
    with open(str(tmp_path / "other"), "w") as f:
        subprocess.run(args, stdout=subprocess.DEVNULL, stderr=f, env=env, cwd=ROOT,
                       timeout=120, check=True)
    assert "<4>" not in (tmp_path / "other").read_text()


def _recipe_block(path, after):
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    block = text[text.index(after):].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()


def test_readme_first_screen_and_the_docs_give_one_recipe():
    with open(os.path.join(ROOT, "README.md")) as f:
        head = f.read().splitlines()
    assert head[2:6] == ["```bash", head[3], head[4], "```"]
    assert head[3].startswith("./scripts/demo ") and head[4].startswith("./scripts/test ")
    readme = _recipe_block("README.md", "On a Jetson")
    assert len(readme) == 6
    assert _recipe_block("docs/platform.md", "## Installing on a Jetson") == readme
    assert readme[1].startswith("./scripts/install-jetson --dry-run")
    assert readme[2].startswith("./scripts/install-jetson ")
    assert readme[4].startswith("jetson-agent diag")  # on PATH: install-jetson links it
    assert readme[5].startswith("jetson-agent selftest")  # the first run on a new board
    with open(os.path.join(ROOT, "docs", "daemon.md")) as f:
        daemon = f.read()
    assert "pip install jetson-agent" not in daemon and "python3 -m venv" not in daemon
    assert "platform.md#installing-on-a-jetson" in daemon


def _version_tuple(text):
    return tuple(int(p) for p in text.split("."))


def test_jetpack_4_daemon_gets_the_jtop_services_jetson_stats_series(tmp_path):
    """Issue 24 defect 4: on JetPack 4.6 the daemon venv got jetson-stats 7.x while the jtop
    service (system Python 3.6) can only be 4.x, and a client of another version is refused."""
    proc = install("--root", os.path.join(PLATFORMS, "nano"), "--prefix", PREFIX)
    r = recipe(proc.stdout)
    assert r["DAEMON_CONSTRAINTS"] == "constraints-jetson4.txt"
    with open(os.path.join(ROOT, "constraints-jetson4.txt")) as f:
        pins = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    (pin,) = [p for p in pins if p.startswith("jetson-stats")]
    upper = [c[1:] for c in pin[len("jetson-stats"):].split(",") if c.startswith("<")]
    assert upper and _version_tuple(upper[0]) <= (5,), pin  # never 7.x
    for tree in ("agx-xavier", "orin-nano", "thor"):  # their service runs the venv's Python
        other = recipe(install("--root", os.path.join(PLATFORMS, tree), "--prefix",
                               PREFIX).stdout)
        assert other["DAEMON_CONSTRAINTS"] == ""
