"""Which devices a controller hears (docs/security.md, "Admission"): the ``Admission`` that
``fleet serve`` and an embedded ``fleet rollout`` run with, from the policy and key file the
operator named."""

from dataclasses import dataclass
from typing import Any, Optional

from agent.errors import AgentError
from agent.fleet.admission import admission


@dataclass
class Policy:
    """``--admission`` (manual, keys, open), ``--admission-keys`` and ``--max-pending``."""
    policy: str = "manual"
    keys_path: Optional[str] = None
    max_pending: int = admission.MAX_PENDING


def make(store: Any, policy: Policy) -> admission.Admission:
    if policy.policy == "keys" and not policy.keys_path:
        raise AgentError("bad_argument", "--admission keys needs --admission-keys FILE (the "
                         "devices' public keys, one per line)")
    keys, bound = admission.load_keys_bindings(policy.keys_path) if \
        policy.keys_path else ({}, {})
    return admission.Admission(store, policy.policy, keys, max_pending=policy.max_pending,
                               keys_path=policy.keys_path, bound=bound)
