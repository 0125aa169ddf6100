"""The previous release, installed from its git commit into a venv of its own (cached), and
helpers that run its daemon and its controller commands: what the compatibility tests put next to
this release's (ARCHITECTURE.md: every protocol change is tested against the previous release in
both directions).

The venv is made in seconds and offline: ``git archive`` of the commit, a venv without pip from
the running interpreter's base Python whose ``.pth`` file adds the running (shared) venv's
site-packages, and ``pip install --no-deps --no-build-isolation`` of the export into it. Only
``agent``/``calib`` differ from the shared venv; every third-party package is the shared one.
The cache: ``$JETSON_AGENT_COMPAT_CACHE`` or ``<repo>/.compat/<commit>``, reused while its
``ready`` marker names the commit and the site-packages it borrows.
"""

import fcntl
import io
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

# The previous release: the commit this round of work started from (the parent of the round's
# first merge). Bump it to the last release's commit when a new round starts.
PREVIOUS_RELEASE = "aaa9d91ab070a356d778e0d7cc7397be2359205a"


class Unavailable(Exception):
    """The previous release cannot be had here (no git history): the tests skip, saying why."""


def git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", ROOT] + list(args), check=True,
                          capture_output=True, timeout=60).stdout


def check_history(commit: str = PREVIOUS_RELEASE) -> None:
    if shutil.which("git") is None:
        raise Unavailable("git is not installed")
    try:
        git("cat-file", "-e", commit + "^{commit}")
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise Unavailable("git history unavailable: commit {} of the previous release is not "
                          "in this clone ({}); a clone with history has it".format(
                              commit[:12], detail.decode("utf-8", "replace").strip()[:200]))


def cache_dir(commit: str = PREVIOUS_RELEASE) -> str:
    return os.environ.get("JETSON_AGENT_COMPAT_CACHE") or os.path.join(ROOT, ".compat",
                                                                      commit[:12])


def shared_site_packages() -> List[str]:
    """The running venv's site-packages (what the previous release's venv borrows)."""
    paths = [p for p in site.getsitepackages() if os.path.isdir(p)]
    purelib = sysconfig.get_paths()["purelib"]
    return paths if purelib in paths else [purelib] + paths


class PreviousRelease(object):
    """The installed previous release: ``python`` (its venv's interpreter), ``env()`` (no
    PYTHONPATH: this checkout's ``agent`` must not win), ``cli(args)``."""

    def __init__(self, root: str, commit: str = PREVIOUS_RELEASE) -> None:
        self.root = root
        self.commit = commit
        self.python = os.path.join(root, "venv", "bin", "python")

    def env(self, extra: Optional[dict] = None) -> dict:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env.pop("JETSON_AGENT_STATE_DIR", None)
        env.update(extra or {})
        return env

    def cli(self, args: List[str], cwd: str, timeout: float = 180,
            env: Optional[dict] = None) -> "subprocess.CompletedProcess[str]":
        """``python -m agent ARGS`` of the previous release (cwd: never this checkout, whose
        ``agent`` would be found first)."""
        return subprocess.run([self.python, "-m", "agent"] + list(args), cwd=cwd,
                              env=self.env(env), capture_output=True, text=True,
                              timeout=timeout)

    def agent_file(self, cwd: str) -> str:
        return subprocess.run([self.python, "-c", "import agent; print(agent.__file__)"],
                              cwd=cwd, env=self.env(), capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()


def install(commit: str = PREVIOUS_RELEASE, root: Optional[str] = None) -> PreviousRelease:
    """The previous release's venv (made once, then reused); raises Unavailable without git
    history."""
    check_history(commit)
    root = root or cache_dir(commit)
    marker = os.path.join(root, "ready")
    stamp = "\n".join([commit] + shared_site_packages()) + "\n"
    os.makedirs(os.path.dirname(root) or ".", exist_ok=True)
    with open(root + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test processes build it once
        if _ready(marker, stamp):
            return PreviousRelease(root, commit)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        src = os.path.join(root, "src")
        with tarfile.open(fileobj=io.BytesIO(git("archive", "--format=tar", commit))) as tar:
            tar.extractall(src)
        venv = os.path.join(root, "venv")
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", "--without-pip", venv], check=True,
                       capture_output=True, timeout=120)
        release = PreviousRelease(root, commit)
        purelib = subprocess.run(
            [release.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        with open(os.path.join(purelib, "_shared_venv.pth"), "w") as f:
            f.write("\n".join(shared_site_packages()) + "\n")
        proc = subprocess.run(
            [release.python, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
             "--no-index", "--no-cache-dir", "--disable-pip-version-check", "-q", src],
            cwd=root, env=release.env(), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError("installing the previous release {} failed:\n{}{}".format(
                commit[:12], proc.stdout[-2000:], proc.stderr[-3000:]))
        where = release.agent_file(root)
        if not where.startswith(purelib):
            raise RuntimeError("the previous release's venv imports agent from {}, expected "
                               "its own site-packages {}".format(where, purelib))
        with open(marker, "w") as f:
            f.write(stamp)
        return release


def _ready(marker: str, stamp: str) -> bool:
    try:
        with open(marker) as f:
            return f.read() == stamp
    except OSError:
        return False
