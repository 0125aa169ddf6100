"""Why a connection to the broker failed, in words a user can act on (Python >= 3.8): the
hints for a wrong CA file, a plain port dialled with TLS, and a client certificate the broker
wants or refuses. Pure text from what ``mqtt`` saw: an exception, or paho's last socket
warning, which ``PahoLog`` keeps for it.
"""

import logging
import ssl
from typing import TYPE_CHECKING, Any, Optional

import paho.mqtt.client as paho

if TYPE_CHECKING:  # the client hands itself in
    from agent.wire.mqtt import MqttClient


def is_failure(rc: Any) -> bool:
    """A reason code (paho 2) or an int return code (paho 1) that says the operation failed."""
    if hasattr(rc, "is_failure"):
        return bool(rc.is_failure)
    return bool(rc)


def reason_text(rc: Any) -> str:
    if isinstance(rc, int) and not hasattr(rc, "is_failure"):
        return paho.connack_string(rc)
    return str(rc)


class PahoLog(object):
    """Stands in for paho's logger: keeps its last warning (the only place the reason for a
    connection closed during the handshake appears); debug messages are not even formatted."""

    def __init__(self, owner: "MqttClient") -> None:
        self.owner = owner

    def log(self, level: int, fmt: str, *args: Any) -> None:
        if level >= logging.WARNING:
            try:
                self.owner._socket_error = (fmt % args)[:300]
            except (TypeError, ValueError):
                self.owner._socket_error = str(fmt)[:300]


def connect_failure(exc: Optional[BaseException], tls_enabled: bool, port: int) -> str:
    """The reason for a failed connect attempt (paho's ``on_connect_fail``)."""
    text = "{}: {}".format(type(exc).__name__, exc) if exc else "connect failed"
    if isinstance(exc, ssl.SSLCertVerificationError):
        text += (" (check the CA file: broker.tls.ca_file or --ca-file must hold "
                 "the CA that signed the broker's certificate)")
    elif tls_enabled and isinstance(exc, (ConnectionResetError, ssl.SSLError, BrokenPipeError)):
        # A plain MQTT listener drops a TLS ClientHello: a reset, EOF or "wrong version".
        text += (" (TLS handshake failed: is port {} a TLS listener? mqtts:// "
                 "needs one, 8883 by convention; use mqtt:// for a plain "
                 "port)".format(port))
    return text


def closed_before_connack(socket_error: str, tls_enabled: bool, has_client_cert: bool) -> str:
    """The reason for a connection the broker closed before its CONNACK."""
    text = "the broker closed the connection before accepting it: {}".format(socket_error)
    upper = socket_error.upper()
    # TLS 1.3 sends the refusal after the handshake: the client may read the alert or,
    # if the broker closed first, only an EOF. Without a certificate, say what's missing.
    closed = tls_enabled and ("EOF" in upper or "RESET" in upper)
    if "CERTIFICATE_REQUIRED" in upper or (closed and not has_client_cert):
        text += (" (the broker requires a client certificate: "
                 "broker.tls.cert_file / --cert-file)")
    elif "UNKNOWN_CA" in upper or "CERTIFICATE" in upper or closed:  # closed: ours, refused
        text += (" (the broker refused the client certificate: is it signed "
                 "by the CA the broker trusts, and still valid?)")
    return text
