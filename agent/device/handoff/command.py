"""The ``command`` hand-off: run a configured command (``systemctl reload my-app``, a script)
when a version becomes current and when the previous one is handed back. An argument list,
never a shell; the model in its environment (``model_env``); its exit status is the hand-off's
result, within ``timeout_s``. Also runs the ``models.probe`` command (the same environment).

    handoff:
      - type: command
        models: ["detector"]
        command: ["systemctl", "reload", "my-app"]
        timeout_s: 60
"""

import os
import signal
import subprocess
from typing import Any, Dict, List, Mapping, Optional, Sequence

from agent.device.handoff.base import Adapter, ModelVersion
from agent.errors import AgentError

DEFAULT_TIMEOUT_S = 60.0
MAX_ARGS = 64
MAX_OUTPUT_BYTES = 2000  # the command's output tail kept for the error message
ENV_PREFIX = "JETSON_AGENT_MODEL_"


def model_env(new: ModelVersion, previous: Optional[ModelVersion], event: str,
              base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The command's environment: the daemon's, plus the model's name, version, engine, meta
    path, directory, previous version ("" if none) and the event (switch | revert)."""
    env = dict(os.environ if base is None else base)
    env.update({
        ENV_PREFIX + "NAME": new.name,
        ENV_PREFIX + "VERSION": new.version,
        ENV_PREFIX + "ENGINE": new.engine,
        ENV_PREFIX + "META": os.path.join(new.path, "meta.json"),
        ENV_PREFIX + "DIR": new.path,
        ENV_PREFIX + "PREVIOUS_VERSION": previous.version if previous else "",
        ENV_PREFIX + "EVENT": event,
    })
    return env


def check_argv(value: Any, where: str) -> List[str]:
    if isinstance(value, str) or not isinstance(value, list) or not value or len(value) > \
            MAX_ARGS or not all(isinstance(a, str) and a and "\0" not in a for a in value):
        raise AgentError("bad_config", "{} expects a list of 1-{} non-empty strings (an "
                         "argument list, never a shell line), found {!r}".format(
                             where, MAX_ARGS, value))
    return list(value)


def run(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> None:
    """Run ``argv``; AgentError handoff_failed on a non-zero exit, a timeout (the command's
    process group killed) or a command that cannot start."""
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    except OSError as exc:
        raise AgentError("handoff_failed", "cannot run {}: {}".format(argv[0], exc.strerror
                                                                      or exc))
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.communicate()
        raise AgentError("handoff_failed", "{} did not finish within {:g} s".format(
            argv[0], timeout_s))
    if proc.returncode != 0:
        tail = (out or b"")[-MAX_OUTPUT_BYTES:].decode("utf-8", "replace").strip()
        raise AgentError("handoff_failed", "{} exited with status {}, expected 0{}".format(
            argv[0], proc.returncode, ": " + tail if tail else ""),
            {"returncode": proc.returncode})


class CommandAdapter(Adapter):
    kind = "command"

    def __init__(self, argv: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.argv = list(argv)
        self.timeout_s = timeout_s

    def switch(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        run(self.argv, model_env(new, previous, "switch"), self.timeout_s)

    def confirm(self, new: ModelVersion) -> Optional[bool]:
        return True  # switch() raised unless the command exited 0

    def revert(self, previous: Optional[ModelVersion], failed: ModelVersion) -> None:
        # The environment describes the version handed back (the failed one when none).
        run(self.argv, model_env(previous or failed, failed if previous else None, "revert"),
            self.timeout_s)


def check_timeout(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not \
            0 < value <= 3600:
        raise AgentError("bad_config", "{} expects seconds in (0, 3600], found {!r}".format(
            where, value))
    return float(value)


def from_config(section: Mapping[str, Any], where: str) -> Adapter:
    unknown = sorted(set(section) - {"command", "timeout_s"})
    if unknown:
        raise AgentError("bad_config", "{}: unknown key {!r}; expected command, timeout_s".format(
            where, unknown[0]))
    if "command" not in section:
        raise AgentError("bad_config", "{}.command: expected an argument list, found "
                         "nothing".format(where))
    return CommandAdapter(check_argv(section["command"], where + ".command"),
                          check_timeout(section.get("timeout_s", DEFAULT_TIMEOUT_S),
                                        where + ".timeout_s"))
