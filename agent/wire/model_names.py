"""Model names and versions as they enter from a job, a command, the CLI or the app socket:
both become path components (``<models_dir>/<name>/<version>``) and environment values, so both
are validated where they enter. Pure."""

import re
from typing import Any

from agent.errors import AgentError

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")


def validate_name(s: Any) -> str:
    """A model name; AgentError bad_model_name."""
    if not isinstance(s, str) or not NAME_RE.match(s) or s in (".", ".."):
        raise AgentError("bad_model_name", "expected a model name of 1-64 lower-case letters, "
                         "digits, '_', '.' or '-' starting with a letter or digit, found {!r}"
                         .format(s if not isinstance(s, str) else s[:80]))
    return s


def validate_version(s: Any) -> str:
    """A model version; AgentError bad_model_version."""
    if not isinstance(s, str) or not VERSION_RE.match(s) or s in (".", ".."):
        raise AgentError("bad_model_version", "expected a model version of 1-64 letters, "
                         "digits, '_', '.', '+' or '-' starting with a letter or digit, found {!r}"
                         .format(s if not isinstance(s, str) else s[:80]))
    return s
