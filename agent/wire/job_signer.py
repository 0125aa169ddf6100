"""Controller side of signed jobs: keys made and loaded, documents signed and numbered.

``fleet keygen`` writes a key pair; a ``Signer`` signs each job document a rollout publishes,
taking its sequence number from a ``SequenceFile`` (per key, above the last one and at least
the clock in milliseconds, so devices never see a number twice). ``cryptography`` is imported
only here and in ``signing.TrustStore.verify``; what is signed is ``signing.manifest``.
"""

import base64
import copy
import json
import math
import os
import time
from typing import Any, Callable, Dict, Mapping, Optional

from agent.errors import AgentError
from agent.fsio import atomic_write, file_lock
from agent.wire.signing import ALG, key_id, manifest, public_key_pem

MAX_SEQ = (1 << 53) - 1  # JSON-safe integer in every language
DEFAULT_VALIDITY_S = 24 * 3600.0


def generate_keypair(out_dir: str, name: str = "jetson-agent-signing") -> Dict[str, str]:
    """Write ``<name>.key`` (PKCS#8 PEM, mode 0600) and ``<name>.pub`` (PEM) into
    ``out_dir``; refuses to overwrite. Returns paths, key_id and the raw key in base64."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if not name or "/" in name or name.startswith("."):
        raise AgentError("bad_argument", "--name must be a plain file name, found {!r}".format(
            name))
    os.makedirs(out_dir, exist_ok=True)
    private_path = os.path.join(out_dir, name + ".key")
    public_path = os.path.join(out_dir, name + ".pub")
    for path in (private_path, public_path):
        if os.path.exists(path):
            raise AgentError("bad_argument", "{} already exists; not overwriting a key (choose "
                             "another --out or --name)".format(path))
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    raw = private.public_key().public_bytes(serialization.Encoding.Raw,
                                            serialization.PublicFormat.Raw)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    atomic_write(public_path, public_key_pem(raw).encode("ascii"))
    os.chmod(public_path, 0o644)  # a public key is for sharing (the temp file was 0600)
    return {"private_key": private_path, "public_key": public_path, "key_id": key_id(raw),
            "public_base64": base64.b64encode(raw).decode("ascii")}


def load_private_key(path: str) -> Any:
    """An Ed25519 private key from a PKCS#8 PEM file; AgentError naming what is wrong."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        with open(path, "rb") as f:
            data = f.read(64 * 1024)
    except OSError as exc:
        raise AgentError("file_not_found", "cannot read the signing key {}: {}".format(
            path, exc.strerror or exc))
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise AgentError("bad_argument", "{}: expected an unencrypted PKCS#8 PEM private key "
                         "(from 'jetson-agent fleet keygen'): {}".format(path, exc))
    if not isinstance(key, Ed25519PrivateKey):
        raise AgentError("bad_argument", "{}: expected an Ed25519 private key, found {}".format(
            path, type(key).__name__))
    return key


def raw_public(private_key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                       serialization.PublicFormat.Raw))


def sign_document(doc: Mapping[str, Any], private_key: Any, seq: int, not_before: float,
                  expires: float, kid: Optional[str] = None,
                  shallow: bool = False) -> Dict[str, Any]:
    """A copy of ``doc`` with its ``signature`` (pure but for the key). ``kid``: the key's id,
    when the caller holds it (not derived again at each document); ``shallow``: the copy
    shares ``doc``'s values, which its caller never changes (a rollout's documents, built for
    one device each and sharing their parts: no deep copy of every document)."""
    if not 1 <= int(seq) <= MAX_SEQ:
        raise AgentError("bad_argument", "sequence must be 1..2**53-1, found {}".format(seq))
    out = dict(doc) if shallow else copy.deepcopy(dict(doc))
    out["signature"] = {"alg": ALG, "key_id": kid or key_id(raw_public(private_key)),
                        "seq": int(seq),
                        "not_before": int(math.floor(not_before)),
                        "expires": int(math.ceil(expires))}
    sig = private_key.sign(manifest(out))
    out["signature"]["sig"] = base64.b64encode(sig).decode("ascii")
    return out


def default_sequence_file() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return os.path.join(base, "jetson-agent", "fleet-sequence.json")


class SequenceFile(object):
    """The controller's last sequence number per signing key: JSON {key_id: seq}, replaced
    atomically under an advisory lock (two rollouts on one host never reuse a number)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _read(self) -> Dict[str, int]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise AgentError("bad_argument", "sequence file {} cannot be read ({}); fix or "
                             "remove it (sequences restart from the clock)".format(
                                 self.path, exc))
        if not isinstance(data, dict):
            return {}
        return {str(k): int(v) for k, v in data.items() if isinstance(v, int)}

    def last(self, kid: str) -> int:
        return self._read().get(kid, 0)

    def next(self, kid: str, floor: int = 0) -> int:
        """Allocate and persist the next sequence for ``kid``: above the stored one and at
        least ``floor`` (the clock in milliseconds, so a lost state file cannot send a
        controller back below what its devices accepted)."""
        with file_lock(self.path + ".lock"):
            data = self._read()
            seq = max(data.get(kid, 0) + 1, int(floor))
            if seq > MAX_SEQ:
                raise AgentError("bad_argument", "sequence of key {} is exhausted".format(kid))
            data[kid] = seq
            atomic_write(self.path, json.dumps(data, sort_keys=True).encode("utf-8"))
            return seq


class Signer(object):
    """Controller side: signs job documents with one key, numbering them from a sequence
    file. ``sign(doc)`` allocates a sequence; ``sign(doc, dry_run=True)`` does not (for
    checking a document's size before a rollout starts)."""

    def __init__(self, key_path: str, sequence_path: Optional[str] = None,
                 validity_s: float = DEFAULT_VALIDITY_S,
                 clock: Callable[[], float] = time.time) -> None:
        if not validity_s > 0:
            raise AgentError("bad_argument", "job validity must be > 0 s, found {}".format(
                validity_s))
        self.private_key = load_private_key(key_path)
        self.key_id = key_id(raw_public(self.private_key))
        self.sequence = SequenceFile(sequence_path or default_sequence_file())
        self.validity_s = float(validity_s)
        self.clock = clock

    def sign(self, doc: Mapping[str, Any], dry_run: bool = False) -> Dict[str, Any]:
        now = self.clock()
        floor = int(now * 1000)
        seq = max(self.sequence.last(self.key_id) + 1, floor) if dry_run else \
            self.sequence.next(self.key_id, floor)
        return sign_document(doc, self.private_key, seq, now, now + self.validity_s)
