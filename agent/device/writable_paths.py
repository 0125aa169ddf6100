"""The paths the daemon must write besides its own directories: the models directory and the
hand-off adapters' (a Triton repository, a DeepStream config file's directory). Under the
shipped unit (``ProtectSystem=strict``) anything not named in ``ReadWritePaths=`` is a
read-only file system, which would otherwise surface only at the first activation; the daemon
warns at start, naming the path and the drop-in that opens it (docs/daemon.md).
"""

import os
from typing import Any, List, Mapping, Optional, Tuple

DROP_IN = "a ReadWritePaths= drop-in, systemd/jetson-agent.service.d/handoff-paths.conf.example"


def handoff_paths(entries: Any) -> List[Tuple[str, str]]:
    """(where, directory) for each configured hand-off path the daemon writes."""
    out: List[Tuple[str, str]] = []
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        if not isinstance(entry, Mapping):
            continue
        where = "handoff[{}]".format(i)
        if entry.get("type") == "triton" and isinstance(entry.get("repository"), str):
            out.append((where + ".repository", entry["repository"]))
        elif entry.get("type") == "deepstream":
            named = entry.get("pipelines")
            named = named if isinstance(named, Mapping) else {}
            places = [(where, entry)] + [("{}.pipelines.{}".format(where, n), p)
                                         for n, p in sorted(named.items(), key=str)
                                         if isinstance(p, Mapping)]
            for at, section in places:
                for key in ("config", "override"):
                    if isinstance(section.get(key), str) and section[key]:
                        out.append(("{}.{}".format(at, key), os.path.dirname(
                            os.path.abspath(os.path.expanduser(section[key])))))
    return out


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def write_problem(path: str) -> Optional[str]:
    """What stops this process writing under ``path`` (or making it), else None."""
    existing = _nearest_existing(path)
    try:
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            return "a read-only file system at {}".format(existing)
    except OSError as exc:
        return "{}: {}".format(existing, exc.strerror or exc)
    if not os.access(existing, os.W_OK | os.X_OK):
        return "{} not writable by uid {}".format(existing, os.geteuid())
    return None


def problems(models_dir: str, handoff: Any) -> List[str]:
    """One message per path the daemon cannot write: what is expected and what was found."""
    out = []
    for where, path in [("models.dir", models_dir)] + handoff_paths(handoff):
        found = write_problem(path)
        if found:
            out.append("{} {}: expected a directory the service may write ({}), found "
                       "{}".format(where, path, DROP_IN if where != "models.dir" else
                                   "install-jetson makes /var/lib/jetson-agent-models", found))
    return out
