"""Signed job documents: Ed25519 over a canonical JSON manifest (docs/security.md).

The controller signs every job document it publishes; a device runs a job only when the
signature verifies against one of its trusted public keys, the job names this device, the
current time is inside the job's validity window and its sequence number is above the last
one accepted from that key (persisted in the journal, so a replay is refused after a restart
too).

What is signed (the *manifest*) is the whole job document with ``signature.sig`` left out:
job id, kind, target device, the sha256 and size of every artifact, the full plan, gate,
search, bench, fallback and timeout, and the signature's own ``key_id``, ``seq``,
``not_before`` and ``expires``. It is serialised canonically (RFC 8785 JSON
Canonicalization: keys sorted by UTF-16 code units, no white space, ECMAScript number
formatting, UTF-8) after a fixed domain prefix, so a controller in any language can produce
the same bytes.

Key files: the private key is PKCS#8 PEM (mode 0600), the public key SubjectPublicKeyInfo
PEM. A device also accepts a public key as the base64 of its 32 raw bytes, inline in its
config or in a file. ``key_id`` is the first 16 hex digits of sha256(raw public key).

Only verification runs on a device (this module), and ``cryptography`` is imported when the
first signed job arrives (the idle daemon stays small): public keys are parsed here without it.
The controller's side (key generation, signing, sequence numbers) is ``job_signer``.
"""

import base64
import binascii
import decimal
import hashlib
import json
import math
import os
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

from agent.errors import AgentError

ALG = "ed25519"
DOMAIN = b"jetson-agent job v1\n"  # signatures over job manifests only, never other bytes
DEFAULT_MAX_SKEW_S = 300.0
# DER prefix of an Ed25519 SubjectPublicKeyInfo (RFC 8410): SEQUENCE { SEQUENCE { OID
# 1.3.101.112 }, BIT STRING (32 bytes) }.
_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
_PEM_PUBLIC = "PUBLIC KEY"


# ============================================================================ canonical JSON

def canonical_json(value: Any) -> bytes:
    """RFC 8785 serialisation of a JSON value (dict, list, str, int, float, bool, None)."""
    return _canon(value).encode("utf-8", "backslashreplace")


def _canon(value: Any) -> str:
    # The usual types by identity first: isinstance against typing's Mapping costs about a
    # microsecond a value, a large share of the canonical form of every signed report.
    t = type(value)
    if t is str:
        return _string(value)
    if t is dict:
        return "{" + ",".join(_string(k) + ":" + _canon(v) for k, v in _sorted_items(value)) \
            + "}"
    if t is int:
        return str(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_canon(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(_string(k) + ":" + _canon(v) for k, v in _sorted_items(value)) \
            + "}"
    raise AgentError("bad_argument", "a job document holds JSON values only, found {}".format(
        type(value).__name__))


# json.dumps(s, ensure_ascii=False) without building an encoder at each call (two per key
# and value of every signed document and report: most of the canonical form's time).
_string = json.encoder.encode_basestring  # type: ignore[attr-defined]


def _sorted_items(value: Mapping[Any, Any]) -> List[Tuple[str, Any]]:
    """(key as a string, value) in UTF-16 code unit order of the keys (RFC 8785); ASCII keys,
    the usual case, sort the same by code point, without encoding each one."""
    items = [(k if isinstance(k, str) else str(k), v) for k, v in value.items()]
    if "".join(k for k, _v in items).isascii():
        items.sort(key=_first)
    else:
        items.sort(key=lambda kv: kv[0].encode("utf-16-be", "surrogatepass"))
    return items


def _first(item: Tuple[str, Any]) -> str:
    return item[0]


def _number(value: float) -> str:
    """ECMAScript Number::toString: the shortest digits that round-trip, fixed notation for
    1e-6 <= |x| < 1e21, else d.ddde+N."""
    if not math.isfinite(value):
        raise AgentError("bad_argument", "a signed job cannot hold NaN or infinity")
    if value == 0:
        return "0"
    if value < 0:
        return "-" + _number(-value)
    _sign, digits_t, exponent = decimal.Decimal(repr(value)).as_tuple()
    digits = "".join(str(d) for d in digits_t).lstrip("0") or "0"
    exp = int(exponent)
    while len(digits) > 1 and digits.endswith("0"):
        digits = digits[:-1]
        exp += 1
    k = len(digits)
    n = exp + k  # value = 0.digits * 10**n
    if k <= n <= 21:
        return digits + "0" * (n - k)
    if 0 < n <= 21:
        return digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return "0." + "0" * (-n) + digits
    e = n - 1
    mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
    return "{}e{}{}".format(mantissa, "+" if e > 0 else "-", abs(e))


def manifest(doc: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: the domain prefix and the canonical document without
    ``signature.sig``."""
    body = dict(doc)
    sig = body.get("signature")
    if isinstance(sig, Mapping):
        body["signature"] = {k: v for k, v in sig.items() if k != "sig"}
    return DOMAIN + canonical_json(body)


# ============================================================================ keys

def key_id(raw_public: bytes) -> str:
    return hashlib.sha256(raw_public).hexdigest()[:16]


def _pem_body(text: str, label: str) -> Optional[bytes]:
    begin, end = "-----BEGIN {}-----".format(label), "-----END {}-----".format(label)
    if begin not in text or end not in text:
        return None
    inner = text.split(begin, 1)[1].split(end, 1)[0]
    try:
        return base64.b64decode("".join(inner.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def parse_public_key(text: str) -> bytes:
    """The 32 raw bytes of an Ed25519 public key given as SubjectPublicKeyInfo PEM, as an
    OpenSSH ``ssh-ed25519 AAAA...`` line, or as base64 of the raw bytes. ValueError else."""
    text = text.strip()
    der = _pem_body(text, _PEM_PUBLIC)
    if der is not None:
        if len(der) != 44 or not der.startswith(_SPKI_PREFIX):
            raise ValueError("a PEM public key, but not an Ed25519 one")
        return der[len(_SPKI_PREFIX):]
    if text.startswith("ssh-ed25519 "):
        blob = base64.b64decode(text.split()[1], validate=True)
        # string "ssh-ed25519", string key: 4-byte lengths
        if len(blob) != 51 or blob[4:15] != b"ssh-ed25519":
            raise ValueError("a malformed ssh-ed25519 key")
        return blob[19:]
    if text.startswith(ALG + ":"):
        text = text[len(ALG) + 1:]
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("neither a PEM public key nor base64")
    if len(raw) != 32:
        raise ValueError("base64 of {} bytes; an Ed25519 public key has 32".format(len(raw)))
    return raw


def public_key_from_spki(der: bytes) -> bytes:
    """The raw key of an Ed25519 SubjectPublicKeyInfo (a PEM body without its armour).
    ValueError else."""
    if len(der) != 44 or not der.startswith(_SPKI_PREFIX):
        raise ValueError("not an Ed25519 SubjectPublicKeyInfo")
    return der[len(_SPKI_PREFIX):]


def public_key_pem(raw: bytes) -> str:
    b64 = base64.b64encode(_SPKI_PREFIX + raw).decode("ascii")
    return "-----BEGIN PUBLIC KEY-----\n{}\n-----END PUBLIC KEY-----\n".format(b64)


def load_trusted_key(entry: str, base_dir: Optional[str] = None) -> Tuple[str, bytes]:
    """One ``security.trusted_keys`` entry -> (key_id, raw). An entry is a file (PEM,
    ssh-ed25519 line or base64; relative names against ``base_dir``) or the key inline
    (``ed25519:BASE64`` or plain base64). AgentError bad_config naming what was wrong."""
    entry = entry.strip()
    path = os.path.expanduser(entry)
    if base_dir and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    looks_inline = entry.startswith(ALG + ":") or (len(entry) == 44 and entry.endswith("="))
    if not looks_inline or os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(64 * 1024)
        except (OSError, UnicodeDecodeError) as exc:
            raise AgentError("bad_config", "security.trusted_keys: {} is neither a readable "
                             "public key file nor an inline key (ed25519:BASE64): {}".format(
                                 entry, getattr(exc, "strerror", None) or exc))
        where = path
    else:
        text, where = entry, "inline key {}".format(entry[:20] + "...")
    try:
        raw = parse_public_key(text)
    except (ValueError, binascii.Error) as exc:
        raise AgentError("bad_config", "security.trusted_keys: {}: expected an Ed25519 public "
                         "key (PEM from 'jetson-agent fleet keygen', ssh-ed25519, or base64 of "
                         "32 bytes), found {}".format(where, exc))
    return key_id(raw), raw


class TrustStore(object):
    """The public keys a device accepts job signatures from (several: key rotation)."""

    def __init__(self, keys: Optional[Mapping[str, bytes]] = None) -> None:
        self.keys: Dict[str, bytes] = dict(keys or {})
        self._loaded: Dict[str, Any] = {}

    @classmethod
    def from_entries(cls, entries: Iterable[str], base_dir: Optional[str] = None
                     ) -> "TrustStore":
        keys: Dict[str, bytes] = {}
        for entry in entries:
            kid, raw = load_trusted_key(entry, base_dir)
            keys[kid] = raw
        return cls(keys)

    def __len__(self) -> int:
        return len(self.keys)

    def key_ids(self) -> List[str]:
        return sorted(self.keys)

    def verify(self, kid: str, message: bytes, signature: bytes) -> bool:
        raw = self.keys.get(kid)
        if raw is None:
            return False
        key = self._loaded.get(kid)
        if key is None:
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

            key = self._loaded[kid] = Ed25519PublicKey.from_public_bytes(raw)
        from cryptography.exceptions import InvalidSignature

        try:
            key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


# ============================================================================ device side

class Accepted(NamedTuple):
    key_id: str
    seq: int


def check_job(doc: Mapping[str, Any], device: str, trust: TrustStore, *,
              allow_unsigned: bool, last_seq: Callable[[str], int],
              now: Optional[float] = None, max_skew_s: float = DEFAULT_MAX_SKEW_S
              ) -> Optional[Accepted]:
    """Decide whether a decoded job document may run on ``device``. Returns the (key id,
    sequence) to record once the job is in the journal, None for an unsigned job accepted
    under ``allow_unsigned``. AgentError ``unsigned_job``, ``bad_signature``,
    ``wrong_target``, ``job_not_yet_valid``, ``job_expired`` or ``job_replayed``."""
    sig = doc.get("signature")
    if sig is None:
        if allow_unsigned:
            return None
        raise AgentError("unsigned_job", "job {} is not signed; this device runs only jobs "
                         "signed by a trusted key (sign with 'jetson-agent fleet rollout "
                         "--signing-key', or set security.allow_unsigned: true on a lab "
                         "device)".format(doc.get("job_id")))
    if not isinstance(sig, Mapping) or sig.get("alg") != ALG:
        raise AgentError("bad_signature", "job {}: expected a signature object with alg "
                         "{!r}, found {!r}".format(doc.get("job_id"), ALG, sig))
    kid = str(sig.get("key_id"))
    if kid not in trust.keys:
        raise AgentError("bad_signature", "job {} is signed with key {}, which this device "
                         "does not trust (security.trusted_keys: {})".format(
                             doc.get("job_id"), kid, ", ".join(trust.key_ids()) or "none"),
                         {"key_id": kid})
    try:
        raw_sig = base64.b64decode(str(sig.get("sig")), validate=True)
    except (binascii.Error, ValueError):
        raw_sig = b""
    if len(raw_sig) != 64 or not trust.verify(kid, manifest(doc), raw_sig):
        raise AgentError("bad_signature", "job {}: the signature does not match the document "
                         "(altered after signing, or signed by another key than {})".format(
                             doc.get("job_id"), kid), {"key_id": kid})
    if doc.get("device") != device:
        raise AgentError("wrong_target", "job {} is signed for device {!r}, not for this "
                         "device {!r}".format(doc.get("job_id"), doc.get("device"), device))
    now = time.time() if now is None else now
    not_before, expires = float(sig["not_before"]), float(sig["expires"])
    if now + max_skew_s < not_before:
        raise AgentError("job_not_yet_valid", "job {} is valid from {} and the device clock "
                         "says {} (off by more than the {:g} s allowed? check NTP)".format(
                             doc.get("job_id"), _iso(not_before), _iso(now), max_skew_s),
                         {"not_before": not_before, "now": now})
    if now - max_skew_s > expires:
        raise AgentError("job_expired", "job {} expired at {} (device clock {})".format(
            doc.get("job_id"), _iso(expires), _iso(now)), {"expires": expires, "now": now})
    seq = int(sig["seq"])
    last = last_seq(kid)
    if seq <= last:
        raise AgentError("job_replayed", "job {} carries sequence {} of key {}, not above the "
                         "last one this device accepted ({}): a replayed or out-of-order "
                         "document".format(doc.get("job_id"), seq, kid, last),
                         {"seq": seq, "last_seq": last, "key_id": kid})
    return Accepted(kid, seq)


def _iso(ts: float) -> str:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
    except (OverflowError, ValueError, OSError):
        return repr(ts)
