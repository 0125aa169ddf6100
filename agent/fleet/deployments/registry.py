"""The model registry: every ``name@version`` the fleet can deploy, with its artifacts (model,
calibration set, inputs and goldens, class labels: content-addressed in the service's artifact
store, each stored once) and its default settings (gate, calibration, search), in the
``model_versions`` table. A version is immutable: pushing anything different under an existing
``name@version`` is ``model_version_exists``; pushing the same again is a no-op.

``fleet models push`` (agent.cli.fleet_models) checks the files; ``push`` puts them into the
registry's own blob store (agent.fleet.database.blobs: the directory the database names, never
a path on the pusher's machine) and records the version with its blob references, from the CLI
on the service's host or from the service's upload endpoint (agent.fleet.deployments.uploads).
This module owns the table: ``put``, ``get``, ``versions``, ``usage`` (who still needs a
version: deployments, devices that keep it) and ``remove`` (refused while used; blobs no
version references any more go with it).
"""

import hashlib
import json
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent.errors import AgentError
from agent.wire import model_names

# The settings a version may carry as its defaults (``fleet rollout``'s argument names).
DEFAULT_KEYS = ("precision", "fallback", "atol", "rtol", "check_error_stat", "min_top1",
                "calib_algorithm", "calib_batch_size", "search", "search_direction",
                "max_evaluations", "bench_iterations", "bench_warmup", "layer_precisions")



def parse_ref(text: str) -> Tuple[str, Optional[str]]:
    """``NAME`` or ``NAME@VERSION``, checked (bad_model_name, bad_model_version)."""
    name, sep, version = str(text).partition("@")
    model_names.validate_name(name)
    if sep:
        return name, model_names.validate_version(version)
    return name, None


def digest(record: Mapping[str, Any]) -> str:
    """What makes a version what it is: its artifacts' hashes, defaults and notes."""
    same = {"artifacts": {r: a.get("sha256") for r, a in (record.get("artifacts") or {}).items()},
            "defaults": record.get("defaults") or {}, "notes": record.get("notes") or ""}
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode("utf-8")).hexdigest()


def put(store: Any, name: str, version: str, record: Mapping[str, Any]) -> bool:
    """Store a version; False when this exact version was there already. AgentError
    model_version_exists when ``name@version`` exists with other contents; bad_model_name,
    bad_model_version, bad_argument (a version the devices' models layout uses) before."""
    model_names.validate_name(name)
    model_names.validate_version(version)
    d = digest(record)
    with store.transaction():
        rows = store.db.query("SELECT digest, record FROM model_versions WHERE name = ? AND "
                              "version = ?", (name, version))
        if rows:
            if rows[0][0] == d:
                return False
            old = json.loads(rows[0][1])
            diff = sorted(k for k in set(old.get("artifacts") or {}) | set(
                record.get("artifacts") or {}) if (old.get("artifacts") or {}).get(k, {}).get(
                "sha256") != (record.get("artifacts") or {}).get(k, {}).get("sha256"))
            raise AgentError("model_version_exists", "{}@{} is in the registry already with "
                             "other contents ({}); expected the same files and settings, or a "
                             "new --version (versions are immutable)".format(
                                 name, version, ", ".join(diff) or "settings or notes differ"))
        store.db.execute("INSERT INTO model_versions (name, version, digest, record, created) "
                         "VALUES (?, ?, ?, ?, ?)", (name, version, d, json.dumps(
                             dict(record), sort_keys=True), time.time()))
    return True


def push(store: Any, root: str, name: str, version: str, record: Mapping[str, Any],
         files: Optional[Mapping[str, str]] = None) -> bool:
    """Store a version and its blobs: ``files`` (role -> local path, ``ROLE.blocks`` too) are
    copied into the store first; without them every blob must be there already (uploaded).
    False when this exact version was there already (its blobs restored if they were lost)."""
    from agent.fleet.database import blobs

    try:
        current: Optional[Dict[str, Any]] = get(store, name, version)
    except AgentError:
        current = None
    if current is not None and current["digest"] != digest(record):
        put(store, name, version, record)  # raises model_version_exists with the difference
    refs = blobs.refs_of(record)
    for role, (sha, size) in sorted(refs.items()):
        if files is not None and role in files:
            blobs.add_file(root, files[role], sha)
        path = blobs.path_of(root, sha)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            raise AgentError("bad_argument", "{}@{}: expected blob {} ({}, {} bytes) in the "
                             "store before the version, found {}".format(
                                 name, version, sha[:16], role, size, "none" if not
                                 os.path.isfile(path) else "{} bytes".format(
                                     os.path.getsize(path))))
    with store.transaction():
        for sha, size in sorted(refs.values()):
            if not os.path.isfile(blobs.path_of(root, sha)):  # collected by an rm meanwhile
                raise AgentError("artifact_unavailable", "{}@{}: blob {} was removed from the "
                                 "store while this push ran (fleet models rm of the last "
                                 "version using it); expected it there: push again".format(
                                     name, version, sha[:16]))
            blobs.register(store, root, sha, size)
        added = put(store, name, version, record)
        blobs.reference(store, name, version, record)
    return added


def _row(r: Tuple[Any, ...]) -> Dict[str, Any]:
    record = json.loads(r[3])
    record.update({"name": r[0], "version": r[1], "digest": r[2], "created": r[4]})
    return record


def get(store: Any, name: str, version: str) -> Dict[str, Any]:
    rows = store.db.query("SELECT name, version, digest, record, created FROM model_versions "
                          "WHERE name = ? AND version = ?", (name, version))
    if not rows:
        known = [v["version"] for v in versions(store, name)]
        raise AgentError("unknown_model_version", "expected a version in the registry, found "
                         "no {}@{} (versions of {}: {}); fleet models push".format(
                             name, version, name, ", ".join(known[:20]) or "none"))
    return _row(rows[0])


def versions(store: Any, name: Optional[str] = None) -> List[Dict[str, Any]]:
    sql = "SELECT name, version, digest, record, created FROM model_versions"
    rows = store.db.query(sql + (" WHERE name = ?" if name else "") + " ORDER BY name, created",
                          (name,) if name else ())
    return [_row(r) for r in rows]


def usage(store: Any, name: str, version: str) -> Dict[str, List[str]]:
    """Who needs ``name@version``: the live deployments of it, and the devices whose models
    message shows it active, pending or kept as the version to go back to."""
    from agent.fleet.database import device_models
    from agent.fleet.deployments import deployments

    deps = [d["deployment_id"] for d in deployments.rows(store)
            if d["name"] == name and d["version"] == version and d["state"] in deployments.LIVE]
    keeping = []
    for dev, msg in sorted(device_models.load(store).items()):
        for m in device_models.entries(None, msg):
            if m["name"] == name and version in (m["version"], m.get("previous")):
                keeping.append(dev)
                break
    return {"deployments": deps, "devices": keeping}


def remove(store: Any, name: str, version: str) -> None:
    get(store, name, version)
    used = usage(store, name, version)
    if used["deployments"] or used["devices"]:
        raise AgentError("model_in_use", "{}@{} is still needed: expected no live deployment "
                         "and no device keeping it, found deployments [{}] and {} device(s) [{}]"
                         " (fleet deployments rm; a device drops a version two versions later)"
                         .format(name, version, ", ".join(used["deployments"]),
                                 len(used["devices"]), ", ".join(used["devices"][:20])),
                         used)
    from agent.fleet.database import blobs

    with store.transaction():
        store.db.execute("DELETE FROM model_versions WHERE name = ? AND version = ?",
                         (name, version))
        root = blobs.recorded(store)
        blobs.unreference(store, root, name, version)
