"""The shipped unit as it runs, for the app setup of docs/using-models.md ("Users and groups"):
the daemon runs as the unit's user (its own group, the unit's SupplementaryGroups= and UMask=)
with the unit's directories and modes (StateDirectoryMode=, RuntimeDirectoryMode=, the models
directory made by install-jetson's own command, the paths the unit hands over in
Environment=), and the app runs as a third user that is in ``models.group`` only, not in the
service's group: it reads the models, commits over the socket; ``app_users`` alone works;
``app_group`` may be a group the service is not in; a stranger gets ``app_not_allowed``. And
``systemd-analyze``: the unit verifies cleanly and its exposure does not get worse.

Needs root (users and groups are made with useradd/groupadd and removed afterwards)."""

import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from tests.integration.conftest import ROOT, AgentProcess
from tests.integration.test_install_jetson import PLATFORMS, SCRIPT, _exposure
from tests.integration.test_named_models import final, named
from tests.unit.device.test_systemd_unit import read_unit, settings, verify

UNIT_MODELS_DIR = "/var/lib/jetson-agent-models"
UNIT_SOCKET = "/run/jetson-agent/app.sock"
# `systemd-analyze security --offline=true` of systemd/jetson-agent.service when the app's
# directories moved out of the state directory (RuntimeDirectory=, ReadWritePaths=): 3.4.
EXPOSURE_NOW = 3.4

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("groupadd"),
    reason="needs root and useradd/groupadd to make the unit's users and groups")


class Accounts:
    """System users and groups named with a random suffix, removed at the end."""

    def __init__(self):
        self.suffix = uuid.uuid4().hex[:6]
        self.users, self.groups = [], []

    def group(self, stem):
        name = "ja{}-{}".format(stem, self.suffix)
        subprocess.run(["groupadd", "--system", name], check=True, capture_output=True)
        self.groups.append(name)
        return name

    def user(self, stem, groups=()):
        name = "ja{}-{}".format(stem, self.suffix)
        cmd = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
        if groups:
            cmd += ["--groups", ",".join(groups)]
        subprocess.run(cmd + [name], check=True, capture_output=True)
        self.users.append(name)
        return name

    def remove(self):
        for name in self.users:
            subprocess.run(["userdel", name], capture_output=True)
        for name in self.groups:
            subprocess.run(["groupdel", name], capture_output=True)


def ids(user):
    import grp
    import pwd

    pw = pwd.getpwnam(user)
    groups = [g.gr_gid for g in grp.getgrall() if user in g.gr_mem]
    return pw.pw_uid, pw.pw_gid, groups


def as_user(user, code, python, env, timeout=60):
    """Run ``code`` as ``user`` (its primary and supplementary groups, like a login)."""
    uid, gid, groups = ids(user)
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                          user=uid, group=gid, extra_groups=groups, cwd="/", timeout=timeout)


def interpreter(user, env):
    """A Python with this tree's packages that ``user`` may run: this one, else the system's
    of the same minor version with this environment's site-packages."""
    probe = "import agent.client, onnxruntime, yaml"
    system = "/usr/bin/python{}.{}".format(*sys.version_info[:2])
    system_env = dict(env, PYTHONPATH=os.pathsep.join([ROOT] + site.getsitepackages()))
    for python, python_env in ((sys.executable, env), (system, system_env)):
        try:
            if as_user(user, probe, python, python_env).returncode == 0:
                return python, python_env
        except OSError:
            continue  # not reachable by that user (a venv under root's home)
    pytest.skip("no Python with this tree's packages that another user may run")


CLIENT = """
import json, os, sys
from agent import client
out = {}
op = sys.argv[-1] if len(sys.argv) > 1 else ""
try:
    if "read" in OPS:
        cur = client.current("det")
        with open(cur.engine, "rb") as f:
            out["engine_bytes"] = len(f.read())
        out["version"] = cur.version
        out["meta_version"] = cur.meta.get("version")
    if "state" in OPS:
        try:
            os.listdir(STATE)
            out["state_listed"] = True
        except PermissionError:
            out["state_listed"] = False
    if "commit" in OPS:
        out["commit"] = client.commit("det")["ok"]
    if "list" in OPS:
        out["list"] = client.request({"op": "list"})["ok"]
except client.ClientError as exc:
    out["error"] = exc.code
    out["message"] = exc.message
print(json.dumps(out))
"""


def client_as(user, ops, python, env, state_dir=""):
    code = "OPS = {!r}\nSTATE = {!r}\n".format(list(ops), state_dir) + CLIENT
    out = as_user(user, code, python, env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def doc_steps():
    """docs/using-models.md, "Users and groups under the shipped unit": its bash block as
    (the useradd command, the config's models section lines, the app's check code)."""
    with open(os.path.join(ROOT, "docs", "using-models.md")) as f:
        text = f.read()
    block = text.split("## Users and groups under the shipped unit", 1)[1]
    block = block.split("```bash\n", 1)[1].split("```", 1)[0]
    useradd = next(line for line in block.splitlines() if line.startswith("sudo useradd "))
    config, inside = [], False
    for line in block.splitlines():
        if line.startswith("#    models:"):
            inside = True
        elif inside and not line.startswith("#      "):
            break
        if inside:
            config.append(line[len("#    "):].split("  #", 1)[0].rstrip())
    check = block.split("-c '", 1)[1].split("'", 1)[0]
    return useradd.split()[1:], config, check


def installer_models_dir_command():
    """install-jetson's own command for the models directory (from its dry run)."""
    proc = subprocess.run(["bash", SCRIPT, "--root", os.path.join(PLATFORMS, "orin-nano")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = [line[2:].split() for line in proc.stderr.splitlines()
             if line.startswith("+ install -d") and line.endswith(" " + UNIT_MODELS_DIR)]
    assert len(lines) == 1, proc.stderr
    return lines[0]


class UnitAgent(AgentProcess):
    """``jetson-agent run`` as the unit runs it: its user and groups, its umask, the paths its
    Environment= names (moved under ``base``)."""

    def __init__(self, broker, workdir, unit_env, user, extra_groups, umask, python, env,
                 extra):
        super().__init__(broker, workdir, "dev1", "")
        with open(self.config) as f:
            self.base_config = f.read()
        self.write_config(extra)
        self.unit_env, self.user = unit_env, user
        self.extra_groups, self.python, self.env = extra_groups, python, env
        self.umask = umask  # the unit's UMask=

    def write_config(self, extra):
        with open(self.config, "w") as f:
            f.write(self.base_config + extra)

    def start(self, *args, env_extra=None):
        uid, gid, _ = ids(self.user)
        env = dict(self.env, **self.unit_env)
        env.pop("JETSON_AGENT_STATE_DIR", None)
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [self.python, "-m", "agent", "-v", "run", "--config", self.config],
                stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=self.workdir, user=uid,
                group=gid, extra_groups=self.extra_groups, umask=self.umask)
        return self


def wait_reply(fn, timeout=60):
    """Until ``fn()`` gives a reply without agent_unreachable (the daemon is listening)."""
    deadline = time.monotonic() + timeout
    while True:
        reply = fn()
        if reply.get("error") != "agent_unreachable" or time.monotonic() > deadline:
            return reply
        time.sleep(0.2)


@needs_root
def test_app_as_a_third_user_under_the_units_users_and_modes(mosquitto, controller,
                                                             digits_files):
    unit = settings(read_unit())["Service"]
    unit_env = dict(v.split("=", 1) for v in unit["Environment"] if v.startswith("JETSON_"))
    assert unit_env == {"JETSON_AGENT_SOCKET": UNIT_SOCKET,
                        "JETSON_AGENT_MODELS_DIR": UNIT_MODELS_DIR}
    assert unit["RuntimeDirectory"] == ["jetson-agent"]
    assert "-" + UNIT_MODELS_DIR in unit["ReadWritePaths"]
    accounts = Accounts()
    base = tempfile.mkdtemp(prefix="unit-", dir="/tmp")
    agent = None
    try:
        os.chmod(base, 0o755)
        # docs/using-models.md, "Users and groups", step by step: install-jetson makes the
        # models group and puts the service in it (SupplementaryGroups=); the app's user is
        # put in that group, and in it only.
        useradd, doc_config, doc_check = doc_steps()
        models_group = accounts.group("m")
        service = accounts.user("s", [models_group])
        app = "jaa-" + accounts.suffix
        as_doc = {"jetson-models": models_group, "myapp": app, "detector": "det"}
        subprocess.run([as_doc.get(a, a) for a in useradd], check=True, capture_output=True)
        accounts.users.append(app)
        other_group = accounts.group("o")  # an app_group the service is not in
        other_app = accounts.user("b", [other_group])
        stranger = accounts.user("x")
        s_uid, s_gid, _ = ids(service)
        import grp

        m_gid = grp.getgrnam(models_group).gr_gid
        unit_groups = [g for g in unit["SupplementaryGroups"][0].split()]
        assert "jetson-models" in unit_groups  # the unit's, here under this test's name

        # The unit's directories: StateDirectory= (its mode), RuntimeDirectory= (its mode),
        # and the models directory as install-jetson makes it.
        paths = {UNIT_SOCKET: os.path.join(base, "run", "jetson-agent", "app.sock"),
                 UNIT_MODELS_DIR: os.path.join(base, "lib", "jetson-agent-models")}
        run_dir = os.path.dirname(paths[UNIT_SOCKET])
        os.makedirs(run_dir)
        os.chmod(os.path.join(base, "run"), 0o755)
        os.chown(run_dir, s_uid, s_gid)
        os.chmod(run_dir, int(unit["RuntimeDirectoryMode"][0], 8))
        os.makedirs(os.path.dirname(paths[UNIT_MODELS_DIR]))
        os.chmod(os.path.dirname(paths[UNIT_MODELS_DIR]), 0o755)
        cmd = installer_models_dir_command()
        cmd = [{"jetson-agent": service, "jetson-models": models_group}.get(a, a) for a in cmd]
        subprocess.run(cmd[:-1] + [paths[UNIT_MODELS_DIR]], check=True)

        env = dict(os.environ, PYTHONPATH=ROOT, **{k: paths[v] for k, v in unit_env.items()})
        python, env = interpreter(stranger, env)
        workdir = os.path.join(base, "agent")
        os.makedirs(workdir)
        os.chmod(workdir, 0o755)
        for word, ours in as_doc.items():
            doc_config = [line.replace(word, ours) for line in doc_config]
            doc_check = doc_check.replace(word, ours)
        assert doc_config[:3] == ["models:", "  group: " + models_group,
                                  "  app_group: " + models_group], doc_config
        extra = "\n".join(doc_config + ["  commit_timeout_s: 180", ""])
        agent = UnitAgent(mosquitto, workdir, {k: paths[v] for k, v in unit_env.items()},
                          service, [m_gid], int(unit["UMask"][0], 8), python, env, extra)
        os.chown(agent.key_path, s_uid, s_gid)
        os.makedirs(agent.state_dir)
        os.chown(agent.state_dir, s_uid, s_gid)
        os.chmod(agent.state_dir, int(unit["StateDirectoryMode"][0], 8))
        agent.start()
        controller.wait_online(timeout=90)

        # 1. models.group = app_group = the app's group: the app reads and commits.
        named(controller, digits_files, "u-1", "det", "v1")
        controller.wait_stage("u-1", "committing", timeout=180)
        got = client_as(app, ["read", "state", "commit"], python, env, agent.state_dir)
        assert got == {"engine_bytes": got["engine_bytes"], "version": "v1",
                       "meta_version": "v1", "state_listed": False, "commit": True}, got
        assert got["engine_bytes"] > 0
        assert final(controller, agent, "u-1")["state"] == "SUCCEEDED"
        checked = as_user(app, doc_check, python, env)  # the docs' step 4, as written
        assert checked.stdout.split() == ["v1", "True"], checked.stdout + checked.stderr
        models = paths[UNIT_MODELS_DIR]
        st = os.stat(models)
        assert (oct(st.st_mode & 0o7777), st.st_gid) == ("0o2750", m_gid)
        engine = os.stat(os.path.join(models, "det", "v1", "model.engine"))
        assert (oct(engine.st_mode & 0o777), engine.st_gid) == ("0o640", m_gid)
        sock = os.stat(paths[UNIT_SOCKET])
        assert (oct(sock.st_mode & 0o777), sock.st_gid) == ("0o660", m_gid)
        refused = client_as(stranger, ["list"], python, env)
        assert refused["error"] == "app_not_allowed", refused
        cli = as_user(stranger, "from agent.cli.models import ask\nfrom agent.errors import "
                      "AgentError\ntry:\n    ask({!r}, {{'op': 'list'}})\nexcept AgentError "
                      "as exc:\n    print(exc.code)".format(paths[UNIT_SOCKET]), python, env)
        assert cli.stdout.split() == ["app_not_allowed"], cli.stdout + cli.stderr  # models CLI
        assert agent.stop() == 0

        # 2. app_users alone: the listed user reaches the socket (its ACL), nobody else.
        agent.write_config("\n".join(line if "app_group" not in line else
                                      "  app_users: [{}]".format(app) for line in doc_config))
        agent.start()
        got = wait_reply(lambda: client_as(app, ["list", "read"], python, env))
        assert got.get("list") is True and got.get("version") == "v1", got
        refused = client_as(stranger, ["list"], python, env)
        assert refused["error"] == "app_not_allowed", refused
        assert agent.stop() == 0

        # 3. app_group the service is not in: the daemon starts, that group's user gets in.
        agent.write_config(("models:\n  group: {}\n  app_group: {}\n").format(
            models_group, other_group))
        agent.start()
        got = wait_reply(lambda: client_as(other_app, ["list"], python, env))
        assert got == {"list": True}, (got, agent.log_tail())
        refused = client_as(stranger, ["list"], python, env)
        assert refused["error"] == "app_not_allowed", refused
        assert refused["message"].startswith("expected a user or group the agent allows")
        assert agent.stop() == 0
    finally:
        if agent is not None and agent.alive():
            agent.kill()
        shutil.rmtree(base, ignore_errors=True)
        accounts.remove()


@needs_root
def test_a_models_group_the_service_is_not_in_stops_the_start_with_a_clear_error(tmp_path):
    from agent.device.models.directory import ModelsDir
    from agent.errors import AgentError

    accounts = Accounts()
    try:
        group = accounts.group("n")
        service = accounts.user("t")
        uid, gid, _ = ids(service)
        pid = os.fork()
        if pid == 0:  # the check as the service user (a child: root stays root)
            code = 1
            try:
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                try:
                    ModelsDir(str(tmp_path / "models"), group)
                except AgentError as exc:
                    code = 0 if exc.code == "bad_config" and "expected the service user to " \
                        "be a member" in exc.message else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
    finally:
        accounts.remove()


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_the_unit_verifies_and_its_exposure_does_not_get_worse(tmp_path):
    rc, complaints = verify(tmp_path, read_unit())
    assert rc == 0 and not complaints, complaints
    path = tmp_path / "jetson-agent.service"
    path.write_text(read_unit())
    score = _exposure(path)
    print("systemd-analyze security exposure: {}".format(score))
    assert score <= EXPOSURE_NOW, "the unit's exposure got worse: {} > {}".format(
        score, EXPOSURE_NOW)
