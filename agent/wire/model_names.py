"""Model names and versions: validated where they enter (a job, a command, a CLI flag, a
models message), because both become path components (``<models_dir>/<name>/<version>``) and
environment values on devices. Pure; Python 3.6-compatible.

- name: ``^[a-z0-9][a-z0-9_.-]{0,63}$``
- version: ``^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$`` (never ``.`` or ``..``: the first character
  is a letter or digit), and never a name the models directory's layout uses (``current``,
  the link to the active version: ``RESERVED_VERSIONS``; the layout's temporary entries start
  with ``.``, which neither pattern allows). A reserved word is ``bad_argument``.
- default version: the first 12 hex digits of the model's SHA-256 (``default_version``); a job
  without a name runs under ``sha-<first 12 hex>`` (``derived_name``).
"""

import re
from typing import Any, List

from agent.errors import AgentError

NAME_PATTERN = r"[a-z0-9][a-z0-9_.-]{0,63}"
VERSION_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}"
_NAME_RE = re.compile(NAME_PATTERN)
_VERSION_RE = re.compile(VERSION_PATTERN)
_SHA_RE = re.compile(r"[0-9a-f]{64}")
RESERVED_VERSIONS = ("current",)  # <models_dir>/<name>/current -> <version>
# The job schema's version pattern: the same, never a reserved word (a lookahead: the schemas
# may use ``$`` only as their end anchor).
JOB_VERSION_PATTERN = r"(?!current(?![A-Za-z0-9_.+-]))" + VERSION_PATTERN
FEATURE = "named_models"  # what a device's status.platform.features says when it knows names


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_name(s: Any) -> str:
    """``s`` if it is a model name; AgentError ``bad_model_name`` otherwise."""
    if not isinstance(s, str) or _NAME_RE.fullmatch(s) is None:
        raise AgentError("bad_model_name", "expected a model name of 1-64 characters of "
                         "[a-z0-9_.-] starting with a lower-case letter or digit, found {}"
                         .format(_shown(s)))
    return s


def validate_version(s: Any) -> str:
    """``s`` if it is a model version; AgentError ``bad_model_version`` otherwise."""
    if not isinstance(s, str) or _VERSION_RE.fullmatch(s) is None or s in (".", ".."):
        raise AgentError("bad_model_version", "expected a model version of 1-64 characters of "
                         "[A-Za-z0-9_.+-] starting with a letter or digit, found {}"
                         .format(_shown(s)))
    if s in RESERVED_VERSIONS:
        raise AgentError("bad_argument", "expected a model version other than {} (the models "
                         "directory's link to the active version), found {}".format(
                             " or ".join(RESERVED_VERSIONS), _shown(s)))
    return s


def name_list(value: Any, where: str, limit: int = 256, empty: bool = False) -> List[str]:
    """A config's list of model names (a single name, or ``"*"`` for every name, allowed;
    ``empty``: [] too); AgentError ``bad_config`` naming ``where`` otherwise."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not (names or empty) or len(names) > limit:
        raise AgentError("bad_config", "{}: expected [\"*\"] or a list of at most {} model "
                         "names, found {}".format(where, limit, _shown(value)))
    for name in names:
        if name != "*":
            try:
                validate_name(name)
            except AgentError as exc:
                raise AgentError("bad_config", "{}: {}".format(where, exc.message))
    return names


def default_version(sha256: str) -> str:
    """The version of a model given without one: the first 12 hex digits of its SHA-256."""
    if not isinstance(sha256, str) or _SHA_RE.fullmatch(sha256) is None:
        raise ValueError("expected a sha256 of 64 lower-case hex digits, found {}".format(
            _shown(sha256)))
    return sha256[:12]


def derived_name(sha256: str) -> str:
    """The name a job without one runs under on a device: ``sha-<first 12 hex>``."""
    return "sha-" + default_version(sha256)


def label(name: Any, version: Any) -> str:
    """``name@version`` for views (either part may be missing: "?")."""
    return "{}@{}".format(name or "?", version or "?")
