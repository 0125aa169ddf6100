"""Which devices a controller hears (docs/security.md, "Admission"): the ``Admission`` that
``fleet serve`` and an embedded ``fleet rollout`` run with, from the policy and key file the
operator named; and ``fleet devices pending|show|trust-legacy|rm`` as data (accept, reject
and rekey are agent.fleet.admission.admission's own calls).
"""

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set

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


def pending(store: Any) -> List[Dict[str, Any]]:
    """The devices waiting for admission: {device, state, key_id, public_key, since, board}."""
    return [{"device": d, "state": r["state"], "key_id": r["pending_key_id"],
             "public_key": r["pending_public_key"], "since": r["pending_since"],
             "board": ((r.get("pending_status") or {}).get("platform") or {}).get("board")}
            for d, r in sorted(store.device_keys().items()) if r.get("pending_key_id")]


def trust_legacy(store: Any, window_s: float) -> float:
    """Pin legacy devices' first keys as they arrive for ``window_s``; until when."""
    until = time.time() + window_s
    store.set_legacy_window(until)
    return until


def show(store: Any, device: str) -> Dict[str, Any]:
    """A device's identity: state, key, keys seen, impostor events (marked viewed: kept in the
    pending list)."""
    from agent.fleet.admission import identity_events

    identity_events.mark_viewed(store, device)
    return dict(admission.identity_view(store, device), device=device)


def decommission(store: Any, device: str, connect: Callable[[], Any], prefix: str) -> int:
    """Unpin the device's key (its rows kept as history) and clear its retained topics; how
    many were cleared."""
    admission.decommission(store, device)
    return clear_retained(connect, prefix, device)


MAX_CLEARED = 100000  # retained topics of one device cleared at most (jobs, status, models)


def clear_retained(connect: Callable[[], Any], prefix: str, device: str, quiet: float = 0.5,
                   limit: float = 10.0) -> int:
    """Every retained message under the device's topics replaced by an empty retained one
    (MQTT's way to delete it): its birth, models, job documents and statuses."""
    import queue

    from agent.wire import mqtt, protocol

    protocol.check_id("device id", device)
    conn = connect()
    try:
        base = "{}/devices/{}/".format(prefix, device)
        conn.client.subscribe(base + "#", 1)
        topics: Set[str] = set()
        deadline, quiet_until = time.monotonic() + limit, None
        while time.monotonic() < deadline:
            if quiet_until is not None and time.monotonic() >= quiet_until:
                break
            try:
                ev = conn.client.events.get(timeout=0.05)
            except queue.Empty:
                continue
            if ev.kind == mqtt.SUBSCRIBED:
                quiet_until = time.monotonic() + quiet
            elif ev.kind == mqtt.MESSAGE and ev.retain and ev.payload and \
                    ev.topic.startswith(base) and len(topics) < MAX_CLEARED:
                topics.add(ev.topic)
                quiet_until = time.monotonic() + quiet
        conn.client.unsubscribe(base + "#")
        for topic in sorted(topics):
            conn.publish(topic, b"", retain=True, wait=10.0)
        return len(topics)
    finally:
        conn.close()
