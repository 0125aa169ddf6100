"""Where the daemon's models directory is, for the commands that must respect it (``build``,
``cache``, ``diag``): ``--models-dir DIR``, else the config's ``models.dir``, else
``<state_dir>/models`` (the daemon's default). Its versions protect their engines in the cache
(``agent.device.models.guard``), so a build with a small ``--cache-budget`` or a ``cache purge``
never removes an engine an application runs.
"""

import argparse
import os
from typing import Any, Optional

MODELS_DIR_HELP = ("the daemon's models directory, whose versions' engines the cache keeps "
                   "(default: the config's models.dir, else STATE_DIR/models)")


def add_models_dir_arg(p: Any) -> None:
    p.add_argument("--models-dir", metavar="DIR", help=MODELS_DIR_HELP)


def _models_section(cfg: Any, key: str) -> Optional[str]:
    section = getattr(cfg, "models", None) if cfg is not None else None
    value = section.get(key) if isinstance(section, dict) else getattr(section, key, None)
    return str(value) if value not in (None, "") else None


def models_dir(args: argparse.Namespace, state_dir: str, cfg: Any = None) -> str:
    """The models directory named by ``--models-dir``, the config, or the state directory."""
    path = getattr(args, "models_dir", None) or _models_section(cfg, "dir") or os.path.join(
        state_dir, "models")
    return os.path.abspath(os.path.expanduser(path))


def models_group(cfg: Any) -> Optional[str]:
    """The group (name or id) that may read the models' files, when the config names one."""
    return _models_section(cfg, "group")
