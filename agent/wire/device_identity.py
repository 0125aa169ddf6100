"""Device identity: a device's own Ed25519 key, and the signatures it puts on what it reports
(docs/security.md, "Device identity").

The key pair is made once (``scripts/install-jetson``, ``jetson-agent keygen --device``) and
kept outside the state directory (``security.device_key``, default ``device.key`` beside the
config file, mode 0600), so a wiped state keeps the identity. Its public key is announced in
the birth status (``platform.identity``); the controller pins it when it admits the device.

Every message a device publishes carries one MQTT v5 user property, ``jas-sig``: compact
JSON ``{"key_id", "boot", "seq", "sig"}`` (and ``"will": true`` on the Will). The signature
covers ``REPORT_DOMAIN`` + the canonical JSON (``signing.canonical_json``) of the device id,
its boot counter, the per-boot sequence, the topic, the job id a job message names, and the
sha256 of the payload: an old signed message cannot be replayed as a newer one (the
controller keeps the last sequence per topic and boot), moved to another topic or device,
or altered. The payload itself is unchanged, so controllers of the previous release (whose
schemas refuse unknown top-level fields) read it as before. The Will is signed once per
connection, for that boot only, and states the connection's session (``platform.identity.
session``, random, also in the birth that follows): a controller drops a Will whose session
is not the device's current one, so a captured Will replayed later changes nothing.
Controllers of the previous release ignore the field (``platform`` allows any).

A builder's shared engine is bound to it the same way: it signs ``ENGINE_DOMAIN`` + the
canonical ``{device, job_id, sha256, size, engine_class}`` of its container
(``engine_statement``), which the fleet service checks before storing an upload and the
adopter checks again with the builder's public key from its signed job document.

``cryptography`` is imported only when a key is loaded or a signature checked.
"""

import base64
import binascii
import hashlib
import json
import os
import sys
import threading
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

from agent.errors import AgentError
from agent.wire.signing import ALG, canonical_json, key_id, parse_public_key

REPORT_DOMAIN = b"jetson-agent report v1\n"
ENGINE_DOMAIN = b"jetson-agent engine v1\n"
PROPERTY = "jas-sig"  # the MQTT v5 user property carrying a report's signature
MAX_PROPERTY = 512
DEFAULT_KEY_NAME = "device.key"


# ============================================================================ keys

class DeviceKey(object):
    """A device's private key, its raw public key and key id."""

    def __init__(self, private: Any, path: str = "") -> None:
        from agent.wire.job_signer import raw_public

        self.private = private
        self.path = path
        self.raw_public = raw_public(private)
        self.key_id = key_id(self.raw_public)

    @property
    def public_base64(self) -> str:
        return base64.b64encode(self.raw_public).decode("ascii")

    def identity(self) -> Dict[str, str]:
        """What the birth status says of it (``platform.identity``)."""
        return {"alg": ALG, "key_id": self.key_id, "public_key": self.public_base64}

    def sign(self, message: bytes) -> str:
        return base64.b64encode(self.private.sign(message)).decode("ascii")


def create_device_key(path: str) -> DeviceKey:
    """Write a new key to ``path`` (PKCS#8 PEM, 0600) and ``path``.pub; never overwrites."""
    from agent.wire.job_signer import generate_keypair, load_private_key

    directory, name = os.path.split(os.path.abspath(path))
    stem = name[:-4] if name.endswith(".key") else name
    if name != stem + ".key":
        raise AgentError("bad_argument", "a device key file ends in .key, found {}".format(path))
    generate_keypair(directory, stem)
    return DeviceKey(load_private_key(path), path)


def load_device_key(path: str) -> DeviceKey:
    """The device key at ``path``; AgentError device_key_unreadable naming the fix."""
    from agent.wire.job_signer import load_private_key

    try:
        return DeviceKey(load_private_key(path), path)
    except AgentError as exc:
        raise AgentError("device_key_unreadable", "security.device_key: expected a readable "
                         "Ed25519 private key at {}, found: {} (make one with 'jetson-agent "
                         "keygen --device {}', or set security.create_device_key: true)".format(
                             path, exc.message, path), {"path": path})


def default_key_path(config_source: Optional[str]) -> str:
    """``device.key`` beside the config file (/etc/jetson-agent/device.key when installed)."""
    base = os.path.dirname(config_source) if config_source else os.path.join(
        os.path.expanduser("~"), ".config", "jetson-agent")
    return os.path.join(base, DEFAULT_KEY_NAME)


def new_session() -> str:
    """A connection's session (``platform.identity.session`` of its birth and its Will): a
    controller takes a Will only while its session is the device's current one."""
    return binascii.hexlify(os.urandom(8)).decode("ascii")


def public_key_of(identity: Any) -> Optional[bytes]:
    """The raw public key a birth status announces (``platform.identity``), or None."""
    if not isinstance(identity, Mapping) or identity.get("alg") != ALG:
        return None
    try:
        return parse_public_key(str(identity.get("public_key") or ""))
    except (ValueError, binascii.Error):
        return None


# ============================================================================ reports

class Signature(NamedTuple):
    key_id: str
    boot: int
    seq: int
    will: bool


def _job_id(payload: bytes) -> Optional[str]:
    if not payload.startswith(b"{"):
        return None
    try:
        msg = json.loads(payload.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    job_id = msg.get("job_id") if isinstance(msg, dict) else None
    return str(job_id) if job_id is not None else None


def report_bytes(device: str, boot: int, seq: int, topic: str, payload: bytes,
                 will: bool = False) -> bytes:
    """What a report's signature covers."""
    body = {"device": device, "boot": int(boot), "seq": int(seq), "topic": topic,
            "job_id": _job_id(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    if will:
        body["will"] = True
    return REPORT_DOMAIN + canonical_json(body)


class ReportSigner(object):
    """Signs a device's publishes for one boot: ``properties(topic, payload)`` -> the user
    properties of the publish (thread-safe: the sequence is taken under a lock)."""

    def __init__(self, key: DeviceKey, device: str, boot: int) -> None:
        self.key, self.device, self.boot = key, device, int(boot)
        self.seq = 0
        self._lock = threading.Lock()

    def properties(self, topic: str, payload: bytes, will: bool = False
                   ) -> List[Tuple[str, str]]:
        with self._lock:
            self.seq += 1
            seq = self.seq
        sig = self.key.sign(report_bytes(self.device, self.boot, seq, topic, payload, will))
        value: Dict[str, Any] = {"key_id": self.key.key_id, "boot": self.boot, "seq": seq,
                                 "sig": sig}
        if will:
            value["will"] = True
        return [(PROPERTY, json.dumps(value, separators=(",", ":"), sort_keys=True))]


def signature_of(user_properties: Any) -> Optional[Dict[str, Any]]:
    """The ``jas-sig`` property of a message, decoded (None: unsigned or malformed)."""
    for name, value in user_properties or ():
        if name != PROPERTY or not isinstance(value, str) or len(value) > MAX_PROPERTY:
            continue
        try:
            data = json.loads(value)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("seq"), int) or \
                not isinstance(data.get("boot"), int) or not isinstance(data.get("sig"), str):
            return None
        return data
    return None


def verify(raw_public: bytes, message: bytes, sig_b64: str) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        sig = base64.b64decode(sig_b64, validate=True)
    except (binascii.Error, ValueError):
        return False
    if len(sig) != 64 or len(raw_public) != 32:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(raw_public).verify(sig, message)
    except InvalidSignature:
        return False
    return True


def verify_report(raw_public: bytes, device: str, topic: str, payload: bytes,
                  user_properties: Any) -> Signature:
    """The signature of a device's message, checked against its key; AgentError
    bad_report_signature saying what was wrong."""
    data = signature_of(user_properties)
    if data is None:
        raise AgentError("bad_report_signature", "a message of {} on {}: expected a {} user "
                         "property signed by the device, found none".format(
                             device, topic, PROPERTY))
    kid = key_id(raw_public)
    if data.get("key_id") != kid:
        raise AgentError("bad_report_signature", "a message of {} on {} is signed with key "
                         "{}, the device's pinned key is {}".format(
                             device, topic, data.get("key_id"), kid))
    will = data.get("will") is True
    if not verify(raw_public, report_bytes(device, data["boot"], data["seq"], topic, payload,
                                           will), data["sig"]):
        raise AgentError("bad_report_signature", "a message of {} on {}: the signature does "
                         "not match (altered, or moved from another topic or device)".format(
                             device, topic))
    return Signature(kid, int(data["boot"]), int(data["seq"]), will)


# ============================================================================ shared engines

def engine_statement(device: str, job_id: str, sha256: str, size: int,
                     engine_class: Any) -> Dict[str, Any]:
    return {"device": device, "job_id": job_id, "sha256": sha256, "size": int(size),
            "engine_class": engine_class}


def sign_engine(key: DeviceKey, statement: Mapping[str, Any]) -> str:
    return key.sign(ENGINE_DOMAIN + canonical_json(dict(statement)))


def verify_engine(raw_public: bytes, statement: Mapping[str, Any], sig_b64: str) -> bool:
    return verify(raw_public, ENGINE_DOMAIN + canonical_json(dict(statement)), sig_b64)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m agent.wire.device_identity sign-engine KEY``: the statement (JSON) on
    stdin, its signature on stdout. The worker (any Python, maybe without ``cryptography``)
    asks the daemon's interpreter this way; the private key never enters the worker."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "sign-engine":
        print("usage: python -m agent.wire.device_identity sign-engine KEY", file=sys.stderr)
        return 2
    try:
        statement = json.loads(sys.stdin.read(64 * 1024))
        if not isinstance(statement, dict):
            raise ValueError("a JSON object is expected")
        print(sign_engine(load_device_key(args[1]), statement))
    except (AgentError, ValueError) as exc:
        print("error: {}".format(getattr(exc, "message", exc)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
