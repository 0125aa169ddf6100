"""Model sets: several names an app uses together, switched and committed together or rolled
back together (docs/using-models.md, "Model sets"; the job's ``model_set``, docs/protocol.md).

Each member comes in its own job carrying the same ``model_set``: ``{"id", "names": [...],
"timeout_s"?}``. The first member's switch opens the set; the device records, before each
member's switch, the version it replaces (``before``), in one small JSON file written
atomically, so a crash anywhere leaves a record to finish from. The set is

- **committed** when every name of the set is active at its set version and committed (each
  member is confirmed as a single version is: probe, adapters, the app);
- **reverted** when any member is rolled back (its app reported it unhealthy, nobody confirmed
  it, an operator rolled it back, a crash expired it), when the app reports a committed member
  unhealthy while the set is open, or when the set's deadline passes before every name came:
  every member still at its set version goes back to its ``before`` version.

One set is open at a time; while it is, a job for one of its names must belong to it
(``bad_model_set``). The decision is ``decide`` (pure); ``ModelSets`` keeps the record.
"""

import json
import logging
import os
import re
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from agent import fsio
from agent.errors import AgentError
from agent.wire.model_names import validate_name

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

FILE = "model_set.json"
FEATURE = "model_sets"  # what a device's status.platform.features says when it knows sets
MAX_NAMES = 8
DEFAULT_TIMEOUT_S = 1800.0
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 10.0, 7 * 86400.0
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

WAIT, COMMITTED, REVERT = "wait", "committed", "revert"


class Spec(NamedTuple):
    id: str
    names: Tuple[str, ...]
    timeout_s: float


def parse(doc: Dict[str, Any]) -> Optional[Spec]:
    """The job's ``model_set`` (None without one); AgentError ``bad_model_set``."""
    raw = doc.get("model_set")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise AgentError("bad_model_set", "expected model_set to be an object {{id, names}}, "
                         "found {}".format(type(raw).__name__))
    sid, names, timeout = raw.get("id"), raw.get("names"), raw.get("timeout_s",
                                                                    DEFAULT_TIMEOUT_S)
    if not isinstance(sid, str) or ID_RE.fullmatch(sid) is None:
        raise AgentError("bad_model_set", "expected model_set.id of 1-64 characters "
                         "[A-Za-z0-9._-], found {!r}".format(str(sid)[:80]))
    if not isinstance(names, list) or not 2 <= len(names) <= MAX_NAMES:
        raise AgentError("bad_model_set", "expected model_set.names to list 2 to {} model "
                         "names, found {}".format(MAX_NAMES, len(names) if isinstance(
                             names, list) else type(names).__name__))
    try:
        checked = tuple(validate_name(n) for n in names)
    except AgentError as exc:
        raise AgentError("bad_model_set", "model_set.names: {}".format(exc.message))
    if len(set(checked)) != len(checked):
        raise AgentError("bad_model_set", "expected model_set.names without repeats, found "
                         "{}".format(", ".join(checked)))
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not MIN_TIMEOUT_S <= timeout <= MAX_TIMEOUT_S:
        raise AgentError("bad_model_set", "expected model_set.timeout_s between {:g} and {:g}, "
                         "found {!r}".format(MIN_TIMEOUT_S, MAX_TIMEOUT_S, timeout))
    name = doc.get("model_name")
    if name not in checked:
        raise AgentError("bad_model_set", "expected the job's model_name to be one of the "
                         "set's names ({}), found {!r}".format(", ".join(checked), name))
    return Spec(sid, checked, float(timeout))


def decide(record: Dict[str, Any], active: Dict[str, Tuple[str, str]],
           now: float) -> Tuple[str, str]:
    """(WAIT | COMMITTED | REVERT, reason) for the open set ``record``; ``active``: name ->
    (active version, its state) from the journal."""
    if record.get("failed"):
        return REVERT, str(record["failed"])
    members: Dict[str, Dict[str, Any]] = record["members"]
    for name, m in sorted(members.items()):
        version, _ = active.get(name, (None, None))
        if version != m["version"]:
            return REVERT, "{}@{} is no longer active (found {})".format(
                name, m["version"], version or "no version")
    if all(n in members and active.get(n, (None, None))[1] == "committed"
           for n in record["names"]):
        return COMMITTED, "every name of the set committed"
    if now >= record["deadline"]:
        missing = [n for n in record["names"] if n not in members]
        return REVERT, "the set was not complete within {:g} s ({})".format(
            record["timeout_s"], "missing " + ", ".join(missing) if missing else
            "not all committed")
    return WAIT, ""


class ModelSets(object):
    """The open set's record (``open``: None when no set is open); ``path`` None keeps it in
    memory only."""

    def __init__(self, path: Optional[str], clock: Any = time.time) -> None:
        self.path, self.clock = path, clock
        self.open: Optional[Dict[str, Any]] = self._read()
        self.closed: Optional[Tuple[str, str]] = None  # (id, outcome) of the last one closed

    @classmethod
    def in_state_dir(cls, state_dir: Optional[str], clock: Any = time.time) -> "ModelSets":
        return cls(os.path.join(state_dir, FILE) if state_dir else None, clock)

    def _read(self) -> Optional[Dict[str, Any]]:
        if not self.path:
            return None
        try:
            with open(self.path, "rb") as f:
                rec = json.loads(f.read(64 * 1024).decode("utf-8"))
            if not isinstance(rec, dict) or not isinstance(rec.get("members"), dict) or \
                    not isinstance(rec.get("names"), list):
                raise ValueError("not a model set record")
            float(rec["deadline"])
            return rec
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("model set record %s unreadable, ignored: %s", self.path, exc)
            return None

    def _save(self) -> None:
        if self.path is None:
            return
        if self.open is None:
            try:
                os.unlink(self.path)
                fsio.fsync_dir(os.path.dirname(self.path))
            except FileNotFoundError:
                pass
            return
        fsio.atomic_write(self.path, json.dumps(self.open, sort_keys=True).encode("utf-8"),
                          mode=0o644)

    def check(self, spec: Optional[Spec], name: str) -> None:
        """Before a job's download: AgentError ``bad_model_set`` when it would mix with the
        open set (one set at a time; its names only through it)."""
        rec = self.open
        if rec is None:
            return
        if spec is None:
            if name in rec["names"]:
                raise AgentError("bad_model_set", "{} belongs to the open model set {} ({}); "
                                 "expected a job of that set, found one without model_set"
                                 .format(name, rec["id"], ", ".join(rec["names"])))
            return
        if spec.id != rec["id"] or list(spec.names) != list(rec["names"]):
            raise AgentError("bad_model_set", "expected a job of the open model set {} ({}), "
                             "found one of set {} ({}); one set is open at a time".format(
                                 rec["id"], ", ".join(rec["names"]), spec.id,
                                 ", ".join(spec.names)))

    def started(self, spec: Spec, name: str, version: str, before: Optional[str]) -> None:
        """Recorded (durably) before ``name`` switches to ``version``."""
        if self.open is None or self.open["id"] != spec.id:
            now = self.clock()
            self.open = {"id": spec.id, "names": list(spec.names), "opened": now,
                         "timeout_s": spec.timeout_s, "deadline": now + spec.timeout_s,
                         "members": {}, "failed": None}
        members = self.open["members"]
        # The version the set replaced stays the target when a name comes twice in one set.
        if name in members and members[name]["version"] != version:
            before = members[name]["before"]
        members[name] = {"version": version, "before": before}
        self._save()

    def member(self, name: str) -> Optional[Dict[str, Any]]:
        return (self.open or {}).get("members", {}).get(name)

    def fail(self, reason: str) -> None:
        if self.open is not None and not self.open.get("failed"):
            self.open["failed"] = reason[:300]
            self._save()

    def close(self, outcome: str) -> None:
        """``outcome``: COMMITTED or REVERT, kept (in memory) as ``closed`` for the job's
        result."""
        if self.open is not None:
            self.closed = (self.open["id"], outcome)
        self.open = None
        self._save()

    def summary(self) -> Optional[Dict[str, Any]]:
        rec = self.open
        if rec is None:
            return None
        return {"id": rec["id"], "names": list(rec["names"]),
                "switched": sorted(rec["members"]), "deadline": rec["deadline"]}


def revert_plan(record: Dict[str, Any],
                active: Dict[str, Tuple[str, str]]) -> List[Tuple[str, str, Optional[str]]]:
    """(name, set version, before) of every member still at its set version."""
    return [(n, m["version"], m["before"]) for n, m in sorted(record["members"].items())
            if active.get(n, (None, None))[0] == m["version"]]
