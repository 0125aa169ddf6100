"""A real ``tritonserver`` (the binary inside the nvidia-pytriton wheel) for tests.

``TritonServer(workdir, repository).start()`` runs it in explicit model control mode on a free
loopback port with the Python backend (the stub copied next to the backend library, as the
wheel's own launcher does; ``LD_LIBRARY_PATH`` at the wheel's bundled libraries), HTTP and gRPC
on loopback (``url``, ``grpc_target``), and returns once ``/v2/health/ready`` answers 200;
``stop()`` then ``start()`` is a restart on the same ports. It runs with
``--disable-auto-complete-config``, as docs/using-models.md advises (the agent writes complete
configurations, and each load then starts one Python-backend stub, not two);
``auto_complete=True`` leaves Triton's auto-completion on. ``unavailable()`` says why the
binary can't run here (None when it can): the tests skip with that reason only.
"""

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request

from tests.integration.conftest import free_port


def wheel_dir():
    spec = importlib.util.find_spec("pytriton")  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def unavailable():
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "the nvidia-pytriton wheel's tritonserver is built for x86-64 Linux only"
    pkg = wheel_dir()
    if pkg is None:
        return "nvidia-pytriton is not installed (requirements-dev.txt)"
    stub = os.path.join(pkg, "tritonserver", "python_backend_stubs",
                        "{}.{}".format(*sys.version_info[:2]), "triton_python_backend_stub")
    if not os.path.isfile(stub):
        return "the wheel has no Python backend stub for Python {}.{}".format(
            *sys.version_info[:2])
    return None


class TritonServer:
    def __init__(self, workdir, repository, extra_args=(), auto_complete=False):
        self.workdir = str(workdir)
        self.extra_args = list(extra_args)  # more tritonserver flags (benchmarks compare them)
        if not auto_complete:
            self.extra_args.insert(0, "--disable-auto-complete-config")
        self.repository = str(repository)
        self.port = free_port()
        self.url = "http://127.0.0.1:{}".format(self.port)
        self.grpc_port = free_port()
        self.grpc_target = "127.0.0.1:{}".format(self.grpc_port)  # the adapter's grpc_url
        self.log = os.path.join(self.workdir, "tritonserver.log")
        self.proc = None

    def _backends(self, pkg):
        backends = os.path.join(self.workdir, "backends")
        python = os.path.join(backends, "python")
        if not os.path.isdir(python):
            shutil.copytree(os.path.join(pkg, "tritonserver", "backends", "python"), python)
            shutil.copy2(os.path.join(pkg, "tritonserver", "python_backend_stubs",
                                      "{}.{}".format(*sys.version_info[:2]),
                                      "triton_python_backend_stub"), python)
        return backends

    def start(self, timeout=60.0):
        pkg = wheel_dir()
        libs = os.path.join(os.path.dirname(pkg), "nvidia_pytriton.libs")
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libs, os.path.join(pkg, "tritonserver", "external_libs"),
                        env.get("LD_LIBRARY_PATH")) if p)
        # The stub's embedded interpreter finds this environment's packages (numpy,
        # onnxruntime) through the `python3` first on PATH.
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
        cmd = [os.path.join(pkg, "tritonserver", "bin", "tritonserver"),
               "--model-repository", self.repository, "--model-control-mode=explicit",
               "--backend-directory", self._backends(pkg), "--http-port", str(self.port),
               "--http-address", "127.0.0.1", "--grpc-port", str(self.grpc_port),
               "--grpc-address", "127.0.0.1", "--allow-metrics=false",
               "--log-verbose=0", "--exit-timeout-secs=5"] + self.extra_args
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("tritonserver exited with status {}: {}".format(
                    self.proc.returncode, self.tail()))
            try:
                with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        raise RuntimeError("tritonserver not ready within {} s: {}".format(timeout, self.tail()))

    def tail(self, n=2000):
        try:
            with open(self.log, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
