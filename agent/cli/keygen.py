"""``jetson-agent keygen --device [PATH]``: this device's own key pair (docs/security.md,
"Device identity"): PATH (PKCS#8 PEM, mode 0600, default /etc/jetson-agent/device.key) and
PATH with .pub for .key, the public key a controller's ``--admission-keys`` file may list. Never
overwrites: a new key is a new identity (the controller puts the device back to pending).
"""

import argparse
import json
from typing import Any

from agent.cli import EXIT_OK

DEFAULT_PATH = "/etc/jetson-agent/device.key"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("keygen", help="make this device's own key pair (device identity)",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", nargs="?", const=DEFAULT_PATH, required=True, metavar="PATH",
                   help="the private key file to write (default %(const)s; security."
                        "device_key in the daemon's config names it)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.wire.device_identity import create_device_key

    key = create_device_key(args.device)
    # generate_keypair writes NAME.key and NAME.pub (not NAME.key.pub)
    out = {"private_key": key.path, "public_key": key.path[:-len(".key")] + ".pub",
           "key_id": key.key_id,
           "public_base64": key.public_base64}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return EXIT_OK
    print("device key: {}  (mode 0600, owned by the daemon's user; outside the state "
          "directory)".format(out["private_key"]))
    print("public key: {}  (key id {}; list it in the controller's --admission-keys file, "
          "or accept the device: fleet devices accept ID)".format(out["public_key"],
                                                                  out["key_id"]))
    return EXIT_OK
