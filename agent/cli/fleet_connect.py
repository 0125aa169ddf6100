"""The broker arguments every ``jetson-agent fleet`` command shares, and ``connect``: one
``FleetConnection`` from them (password file, TLS files checked readable first).
"""

import argparse
import os

from agent import fleet
from agent.errors import AgentError
from agent.wire.topics import DEFAULT_PREFIX


def add_connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("broker")
    g.add_argument("--broker", metavar="URL",
                   default=os.environ.get("JETSON_AGENT_FLEET_BROKER", "mqtt://localhost:1883"),
                   help="mqtt://HOST:PORT or mqtts://HOST:PORT (default $JETSON_AGENT_FLEET_BROKER "
                        "or mqtt://localhost:1883)")
    g.add_argument("--prefix", default=DEFAULT_PREFIX,
                   help="topic prefix (default %(default)s)")
    g.add_argument("--username", help="MQTT user name")
    g.add_argument("--password-file", metavar="FILE", help="file holding the MQTT password")
    g.add_argument("--ca-file", metavar="FILE", help="CA bundle for TLS (implies TLS)")
    g.add_argument("--cert-file", metavar="FILE",
                   help="client certificate for mutual TLS (with --key-file; implies TLS)")
    g.add_argument("--key-file", metavar="FILE", help="the client certificate's private key")
    g.add_argument("--mqtt", choices=("v5", "v3.1.1"), default="v5",
                   help="MQTT protocol version (default v5)")
    g.add_argument("--connect-timeout", type=float, default=5.0, metavar="S",
                   help="give up connecting after S seconds (default 5)")


def connect(args: argparse.Namespace) -> fleet.FleetConnection:
    password = None
    if args.password_file:
        try:
            with open(args.password_file) as f:
                password = f.read().strip()
        except OSError as exc:
            raise AgentError("file_not_found", "cannot read --password-file {}: {}".format(
                args.password_file, exc.strerror))
    if (args.cert_file is None) != (args.key_file is None):
        raise AgentError("bad_argument", "--cert-file and --key-file go together (mutual TLS); "
                         "found only {}".format("--cert-file" if args.cert_file else
                                                "--key-file"))
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(args, name)
        if path is not None and not os.access(path, os.R_OK):
            raise AgentError("file_not_found", "--{} {} cannot be read".format(
                name.replace("_", "-"), path))
    conn = fleet.FleetConnection(args.broker, args.prefix, username=args.username,
                                 password=password, ca_file=args.ca_file,
                                 protocol_version=args.mqtt,
                                 connect_timeout=args.connect_timeout,
                                 cert_file=args.cert_file, key_file=args.key_file)
    return conn.connect()
