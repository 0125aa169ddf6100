"""The device's security posture for ``diag`` (docs/security.md): TLS, broker authentication,
job signing and limits, with a warning ``{problem, fix}`` for each weak spot (Python >= 3.8).
"""

from typing import Any, Dict, List

from agent.errors import AgentError
from agent.wire.signing import TrustStore


def posture(cfg: Any) -> Dict[str, Any]:
    """The device's security posture for ``diag`` (docs/security.md): TLS, broker
    authentication, signing, limits, and warnings ``[{problem, fix}]``."""
    broker, sec, limits = cfg.broker, cfg.security, cfg.limits
    tls = bool(broker.tls.enabled)
    client_cert = tls and bool(broker.tls.cert_file)
    auth = "certificate" if client_cert else "password" if broker.password else (
        "username" if broker.username else "none")
    kids: List[str] = []
    problems: List[Dict[str, str]] = []
    try:
        kids = TrustStore.from_entries(sec.trusted_keys).key_ids()
    except AgentError as exc:
        problems.append({"problem": exc.message, "fix": "fix security.trusted_keys"})
    signing_mode = "required" if not sec.allow_unsigned else ("optional" if kids else "off")
    if sec.allow_unsigned:
        problems.append({
            "problem": "security.allow_unsigned is true: any client that can publish to this "
                       "device's job topics can make it download, build and activate models",
            "fix": "create a key with 'jetson-agent fleet keygen', add its .pub to "
                   "security.trusted_keys, sign rollouts with --signing-key, and remove "
                   "allow_unsigned"})
    elif not kids:
        problems.append({
            "problem": "no trusted signing key (security.trusted_keys is empty) and unsigned "
                       "jobs are refused: every job document will be ignored (it proves "
                       "nothing, so it is dropped without a job status; a controller of this "
                       "release refuses to send unsigned rollouts here)",
            "fix": "add the controller's public key (from 'jetson-agent fleet keygen') to "
                   "security.trusted_keys"})
    if not tls:
        problems.append({
            "problem": "the broker connection is not encrypted (broker.tls is off): job "
                       "documents, artifacts and credentials cross the network in clear",
            "fix": "serve MQTT over TLS (systemd/mosquitto/jetson-fleet.conf) and set "
                   "broker.tls.ca_file"})
    elif broker.tls.insecure:
        problems.append({
            "problem": "broker.tls.insecure is true: the broker's host name is not checked",
            "fix": "give the broker a certificate for the name the devices use and remove "
                   "broker.tls.insecure"})
    return {"tls": tls, "verify_server": tls and not broker.tls.insecure,
            "client_certificate": client_cert, "broker_auth": auth, "signing": signing_mode,
            "trusted_keys": kids, "allow_unsigned": bool(sec.allow_unsigned),
            "max_clock_skew_s": sec.max_clock_skew_s,
            "jobs_per_minute": limits.jobs_per_minute, "job_burst": limits.job_burst,
            "problems": problems}
