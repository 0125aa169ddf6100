"""Signed job documents: canonical JSON, keys, signing and the device's checks."""

import base64
import json
import os
import stat
import threading

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.errors import AgentError
from agent.wire import job_signer, protocol, signing

NOW = 1_750_000_000.0
SHA = "ab" * 32


def doc(job_id="deploy-1", device="dev1", **extra):
    d = {"protocol": 1, "job_id": job_id, "kind": "deploy", "device": device,
         "created": NOW, "artifacts": {"model": {"sha256": SHA, "size": 1234,
                                                 "name": "m.onnx"}},
         "plan": {"precision": "int8", "layer_precisions": {"Softmax_3": "float32"},
                  "calibration": {"algorithm": "entropy2", "batch_size": 8}},
         "gate": {"atol": 0.01, "rtol": 0.001, "min_top1": 0.99},
         "bench": {"iterations": 200, "warmup": 20}, "timeout_s": 3600}
    d.update(extra)
    return d


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    a = job_signer.generate_keypair(str(d), "a")
    b = job_signer.generate_keypair(str(d), "b")
    return {"a": a, "b": b, "dir": str(d)}


def signed(keys, name="a", seq=10, not_before=NOW - 10, expires=NOW + 3600, **kw):
    key = job_signer.load_private_key(keys[name]["private_key"])
    return job_signer.sign_document(doc(**kw), key, seq, not_before, expires)


def check(d, trust, last=0, now=NOW, allow_unsigned=False, device="dev1"):
    return signing.check_job(d, device, trust, allow_unsigned=allow_unsigned,
                             last_seq=lambda kid: last, now=now, max_skew_s=300)


def trust_of(keys, *names):
    return signing.TrustStore.from_entries([keys[n]["public_key"] for n in names])


# --------------------------------------------------------------------------- canonical JSON

def test_canonical_json_matches_rfc8785_example():
    text = ('{"numbers":[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001],'
            '"string":"\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
            '"literals":[null,true,false]}')
    expected = ('{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,'
                '1e-27],"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}')
    assert signing.canonical_json(json.loads(text)) == expected.encode("utf-8")


@pytest.mark.parametrize("value, text", [
    (0.0, "0"), (-0.0, "0"), (1.0, "1"), (100.0, "100"), (-1.5, "-1.5"), (1e20, "1" + "0" * 20),
    (1e21, "1e+21"), (1e-6, "0.000001"), (1e-7, "1e-7"), (123.456, "123.456"),
    (5e-324, "5e-324"), (1.7976931348623157e308, "1.7976931348623157e+308"), (0.1, "0.1"),
    (2 ** 53, str(2 ** 53)), (True, "true"), (None, "null")])
def test_canonical_numbers_follow_ecmascript(value, text):
    assert signing.canonical_json(value) == text.encode()


def test_keys_sort_by_utf16_code_units_and_int_float_agree():
    # U+1F600 is a surrogate pair (0xD83D...) and sorts before U+E000 in UTF-16.
    assert signing.canonical_json({"\ue000": 1, "\U0001f600": 2, "a": 3}) == \
        '{"a":3,"\U0001f600":2,"\ue000":1}'.encode("utf-8")
    assert signing.canonical_json({"x": 1}) == signing.canonical_json({"x": 1.0})


def test_canonical_json_refuses_non_json():
    with pytest.raises(AgentError) as exc:
        signing.canonical_json({"x": float("nan")})
    assert exc.value.code == "bad_argument"
    with pytest.raises(AgentError):
        signing.canonical_json({"x": object()})


def test_manifest_leaves_out_only_the_signature_bytes(keys):
    d = signed(keys)
    m = signing.manifest(d)
    assert m.startswith(signing.DOMAIN)
    body = json.loads(m[len(signing.DOMAIN):])
    assert "sig" not in body["signature"] and body["signature"]["seq"] == 10
    assert body["artifacts"]["model"]["sha256"] == SHA and body["plan"] == d["plan"]


# --------------------------------------------------------------------------- keys

def test_keygen_writes_a_private_file_0600_and_refuses_to_overwrite(keys):
    a = keys["a"]
    assert stat.S_IMODE(os.stat(a["private_key"]).st_mode) == 0o600
    assert len(a["key_id"]) == 16
    with open(a["public_key"]) as f:
        assert f.read().startswith("-----BEGIN PUBLIC KEY-----")
    with pytest.raises(AgentError) as exc:
        job_signer.generate_keypair(keys["dir"], "a")
    assert exc.value.code == "bad_argument" and "already exists" in exc.value.message


def test_public_keys_in_every_accepted_form(keys, tmp_path):
    kid, raw = signing.load_trusted_key(keys["a"]["public_key"])
    assert kid == keys["a"]["key_id"]
    inline = keys["a"]["public_base64"]
    assert signing.load_trusted_key(inline) == (kid, raw)
    assert signing.load_trusted_key("ed25519:" + inline) == (kid, raw)
    b64file = tmp_path / "k.b64"
    b64file.write_text(inline + "\n")
    assert signing.load_trusted_key("k.b64", base_dir=str(tmp_path)) == (kid, raw)
    private = job_signer.load_private_key(keys["a"]["private_key"])
    ssh = private.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                            serialization.PublicFormat.OpenSSH)
    assert signing.parse_public_key(ssh.decode() + " comment") == raw
    # cryptography's own PEM is the same bytes as ours
    pem = private.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    assert signing.public_key_pem(raw).encode() == pem


@pytest.mark.parametrize("entry, needle", [
    ("/nonexistent/key.pub", "neither a readable"),
    ("ed25519:AAAA", "32"),
    ("ed25519:not base64!", "base64"),
])
def test_bad_trusted_keys_are_config_errors(entry, needle):
    with pytest.raises(AgentError) as exc:
        signing.load_trusted_key(entry)
    assert exc.value.code == "bad_config" and needle in exc.value.message


def test_a_private_key_or_an_rsa_key_is_not_a_public_key(keys, tmp_path):
    with pytest.raises(AgentError) as exc:
        signing.load_trusted_key(keys["a"]["private_key"])
    assert exc.value.code == "bad_config"
    rsa_pub = ("-----BEGIN PUBLIC KEY-----\n" + base64.b64encode(b"\x30\x82" + b"\0" * 40)
               .decode() + "\n-----END PUBLIC KEY-----\n")
    p = tmp_path / "rsa.pub"
    p.write_text(rsa_pub)
    with pytest.raises(AgentError) as exc:
        signing.load_trusted_key(str(p))
    assert "not an Ed25519" in exc.value.message


def test_load_private_key_errors(tmp_path, keys):
    with pytest.raises(AgentError) as exc:
        job_signer.load_private_key(str(tmp_path / "missing.key"))
    assert exc.value.code == "file_not_found"
    with pytest.raises(AgentError) as exc:
        job_signer.load_private_key(keys["a"]["public_key"])
    assert exc.value.code == "bad_argument"


# --------------------------------------------------------------------------- device checks

def test_a_signed_document_is_valid_and_verifies(keys):
    d = signed(keys)
    protocol.validate("job", d)
    assert len(protocol.encode(d)) < protocol.MAX_BYTES["job"]
    # through the wire and back: same verdict
    wire = protocol.decode("job", protocol.encode(d))
    assert check(wire, trust_of(keys, "a")) == signing.Accepted(keys["a"]["key_id"], 10)


def test_key_rotation_several_trusted_keys(keys):
    trust = trust_of(keys, "a", "b")
    assert check(signed(keys, "a"), trust).key_id == keys["a"]["key_id"]
    assert check(signed(keys, "b"), trust).key_id == keys["b"]["key_id"]
    with pytest.raises(AgentError) as exc:
        check(signed(keys, "b"), trust_of(keys, "a"))
    assert exc.value.code == "bad_signature" and keys["b"]["key_id"] in exc.value.message


def test_unsigned_jobs(keys):
    with pytest.raises(AgentError) as exc:
        check(doc(), trust_of(keys, "a"))
    assert exc.value.code == "unsigned_job"
    assert check(doc(), trust_of(keys, "a"), allow_unsigned=True) is None
    # allow_unsigned never lets a bad signature through
    bad = signed(keys)
    bad["plan"]["precision"] = "fp16"
    with pytest.raises(AgentError) as exc:
        check(bad, trust_of(keys, "a"), allow_unsigned=True)
    assert exc.value.code == "bad_signature"


@pytest.mark.parametrize("tamper", [
    lambda d: d["artifacts"]["model"].update(sha256="cd" * 32),
    lambda d: d["artifacts"]["model"].update(size=1235),
    lambda d: d["plan"]["layer_precisions"].pop("Softmax_3"),
    lambda d: d["gate"].update(atol=1.0),
    lambda d: d["bench"].update(iterations=201),
    lambda d: d.update(timeout_s=3601),
    lambda d: d.update(job_id="deploy-2"),
    lambda d: d.update(kind="bench"),
    lambda d: d.update(fallback=["fp32"]),
    lambda d: d["signature"].update(seq=11),
    lambda d: d["signature"].update(expires=d["signature"]["expires"] + 1),
    lambda d: d["signature"].update(not_before=0),
    lambda d: d["signature"].update(sig=base64.b64encode(b"\0" * 64).decode()),
    lambda d: d["signature"].update(sig="!" * 88),
    lambda d: d["signature"].update(alg="rsa"),
])
def test_any_change_after_signing_is_refused(keys, tamper):
    d = signed(keys)
    tamper(d)
    with pytest.raises(AgentError) as exc:
        check(d, trust_of(keys, "a"))
    assert exc.value.code == "bad_signature"


def test_a_signature_moved_onto_another_document_is_refused(keys):
    one, two = signed(keys, job_id="one"), signed(keys, job_id="two", seq=11)
    one["signature"] = two["signature"]
    with pytest.raises(AgentError) as exc:
        check(one, trust_of(keys, "a"))
    assert exc.value.code == "bad_signature"


def test_wrong_target(keys):
    with pytest.raises(AgentError) as exc:
        check(signed(keys, device="dev2"), trust_of(keys, "a"), device="dev1")
    assert exc.value.code == "wrong_target" and "dev2" in exc.value.message


def test_validity_window_with_clock_skew(keys):
    trust = trust_of(keys, "a")
    d = signed(keys, not_before=NOW, expires=NOW + 60)
    assert check(d, trust, now=NOW - 299)  # within the skew
    with pytest.raises(AgentError) as exc:
        check(d, trust, now=NOW - 301)
    assert exc.value.code == "job_not_yet_valid" and "NTP" in exc.value.message
    assert check(d, trust, now=NOW + 60 + 299)
    with pytest.raises(AgentError) as exc:
        check(d, trust, now=NOW + 60 + 301)
    assert exc.value.code == "job_expired"


def test_replays_by_sequence(keys):
    trust = trust_of(keys, "a")
    assert check(signed(keys, seq=10), trust, last=9).seq == 10
    for last in (10, 11):
        with pytest.raises(AgentError) as exc:
            check(signed(keys, seq=10), trust, last=last)
        assert exc.value.code == "job_replayed"
        assert exc.value.details == {"seq": 10, "last_seq": last, "key_id": keys["a"]["key_id"]}


def test_the_order_of_checks_tells_the_truth(keys):
    """A forged document is bad_signature even when it is also expired and replayed."""
    d = signed(keys, seq=1, expires=NOW - 10000, device="dev2")
    d["plan"]["precision"] = "fp32"
    with pytest.raises(AgentError) as exc:
        check(d, trust_of(keys, "a"), last=5)
    assert exc.value.code == "bad_signature"


# --------------------------------------------------------------------------- controller side

def test_signer_numbers_documents_from_a_sequence_file(keys, tmp_path):
    clock = [NOW]
    seqfile = str(tmp_path / "state" / "seq.json")
    signer = job_signer.Signer(keys["a"]["private_key"], seqfile, validity_s=600,
                               clock=lambda: clock[0])
    first = signer.sign(doc("j1"))
    second = signer.sign(doc("j2"))
    assert second["signature"]["seq"] == first["signature"]["seq"] + 1
    assert first["signature"]["seq"] >= int(NOW * 1000)  # the clock is the floor
    assert first["signature"]["expires"] - first["signature"]["not_before"] == 600
    dry = signer.sign(doc("j3"), dry_run=True)
    assert dry["signature"]["seq"] == second["signature"]["seq"] + 1
    assert signer.sign(doc("j3"))["signature"]["seq"] == dry["signature"]["seq"]
    with open(seqfile) as f:
        assert json.load(f) == {signer.key_id: dry["signature"]["seq"]}
    # A lost state file and a clock that moved on: still above what devices accepted.
    os.unlink(seqfile)
    clock[0] += 1
    assert signer.sign(doc("j4"))["signature"]["seq"] > dry["signature"]["seq"]
    protocol.validate("job", first)
    trust = trust_of(keys, "a")
    assert check(first, trust, now=NOW).seq == first["signature"]["seq"]


def test_sequence_file_is_safe_under_concurrent_signers(tmp_path):
    seq = job_signer.SequenceFile(str(tmp_path / "seq.json"))
    got = []
    lock = threading.Lock()

    def work():
        for _ in range(25):
            n = seq.next("k")
            with lock:
                got.append(n)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(1, 101))
    assert seq.last("k") == 100


def test_corrupt_sequence_file_is_a_clear_error(tmp_path):
    p = tmp_path / "seq.json"
    p.write_text("{not json")
    with pytest.raises(AgentError) as exc:
        job_signer.SequenceFile(str(p)).next("k")
    assert exc.value.code == "bad_argument" and str(p) in exc.value.message


def test_foreign_signer_interoperates():
    """A controller in another language signs the same manifest bytes with any Ed25519
    library: here cryptography directly, over manifest()."""
    key = Ed25519PrivateKey.generate()
    raw = key.public_key().public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
    d = doc()
    d["signature"] = {"alg": "ed25519", "key_id": signing.key_id(raw), "seq": 3,
                      "not_before": int(NOW), "expires": int(NOW) + 60}
    d["signature"]["sig"] = base64.b64encode(key.sign(signing.manifest(d))).decode()
    trust = signing.TrustStore({signing.key_id(raw): raw})
    assert check(d, trust).seq == 3


def test_the_journal_keeps_the_last_sequence_per_key(tmp_path):
    from agent.device.journal.store import Journal

    path = str(tmp_path / "j.sqlite3")
    with Journal(path) as journal:
        assert journal.last_sequence("k1") == 0
        journal.record_sequence("k1", 10)
        journal.record_sequence("k1", 7)  # never lowered
        journal.record_sequence("k2", 3)
    with Journal(path) as journal:  # persisted: a replay is refused after a restart too
        assert (journal.last_sequence("k1"), journal.last_sequence("k2")) == (10, 3)
        assert journal.boot() == 0  # the boot counter (same table) is untouched
