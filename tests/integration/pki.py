"""A throw-away fleet PKI (CA, broker certificate for 127.0.0.1/localhost, client
certificates whose CN is the device id) made with ``cryptography``, and a Mosquitto started
from the shipped fleet configuration (systemd/mosquitto/) with its paths and port replaced."""

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.integration.conftest import Broker, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLEET_CONF = os.path.join(ROOT, "systemd", "mosquitto", "jetson-fleet.conf")
FLEET_ACL = os.path.join(ROOT, "systemd", "mosquitto", "jetson-fleet.acl")


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key, path):
    with open(path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.TraditionalOpenSSL,
                                  serialization.NoEncryption()))
    os.chmod(path, 0o644)  # the broker may drop root for its own user before reading it


def _write_cert(cert, path):
    with open(path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))


class Pki(object):
    """``Pki(dir, "fleet-ca")``: a CA; ``server()`` and ``client(cn)`` issue certificates and
    return (cert path, key path)."""

    def __init__(self, directory, name="fleet-ca"):
        self.dir = str(directory)
        os.makedirs(self.dir, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(hours=1))
                     .not_valid_after(now + datetime.timedelta(days=2))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                                  False, False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.ca_file = os.path.join(self.dir, name + ".crt")
        _write_cert(self.cert, self.ca_file)

    def _issue(self, cn, server):
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(_name(cn))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage(
                       [ExtendedKeyUsageOID.SERVER_AUTH if server else
                        ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_path = os.path.join(self.dir, cn + ".crt")
        key_path = os.path.join(self.dir, cn + ".key")
        _write_cert(cert, cert_path)
        _write_key(key, key_path)
        return cert_path, key_path

    def server(self, cn="broker"):
        return self._issue(cn, server=True)

    def client(self, cn):
        return self._issue(cn, server=False)


def render_fleet_conf(port, pki, server_cert, server_key, workdir, passwords=None,
                      acl_file=FLEET_ACL):
    """The shipped jetson-fleet.conf with this test's port and files. ``passwords``: the
    documented password variant (``require_certificate false`` + ``password_file``)."""
    with open(FLEET_CONF) as f:
        text = f.read()
    replace = {
        "listener 8883\n": "listener {} 127.0.0.1\n".format(port),
        "/etc/mosquitto/certs/fleet-ca.crt": pki.ca_file,
        "/etc/mosquitto/certs/broker.crt": server_cert,
        "/etc/mosquitto/certs/broker.key": server_key,
        "/etc/mosquitto/conf.d/jetson-fleet.acl": acl_file,
        "/var/lib/mosquitto/": os.path.join(str(workdir), "persist") + "/",
    }
    if passwords is not None:
        replace["require_certificate true\nuse_identity_as_username true\n"] = (
            "require_certificate false\npassword_file {}\n".format(passwords))
    for old, new in replace.items():
        assert old in text, "the shipped fleet config no longer holds {!r}".format(old)
        text = text.replace(old, new)
    os.makedirs(os.path.join(str(workdir), "persist"), exist_ok=True)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # As root, Mosquitto switches to its own user before reading the password file and
        # the ACL, which it could then not read under pytest's private temporary directory.
        text += "user root\n"
    return text


class FleetBroker(Broker):
    """Mosquitto running the shipped fleet configuration (TLS, ACL)."""

    def __init__(self, workdir, pki, passwords=None):
        self.workdir = str(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.port = free_port()
        self.pki = pki
        server_cert, server_key = pki.server()
        self.config = os.path.join(self.workdir, "mosquitto.conf")
        self.log = os.path.join(self.workdir, "mosquitto.log")
        with open(self.config, "w") as f:
            f.write(render_fleet_conf(self.port, pki, server_cert, server_key, self.workdir,
                                      passwords))
        self.proc = None

    @property
    def url(self):
        return "mqtts://{}:{}".format(self.host, self.port)


def write_passwords(path, users):
    """A Mosquitto password file made with ``mosquitto_passwd -b`` (user -> password)."""
    import subprocess

    first = True
    for user, password in users.items():
        args = ["mosquitto_passwd"] + (["-c"] if first else []) + ["-b", str(path), user,
                                                                   password]
        subprocess.run(args, check=True, capture_output=True)
        first = False
    os.chmod(str(path), 0o644)
    return str(path)
