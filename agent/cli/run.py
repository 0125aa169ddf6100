"""``jetson-agent run``: the daemon (what the systemd unit starts).

Settings come from the YAML config (``--config``), then JETSON_AGENT_* variables, then these
flags. With no config file the defaults serve a broker on localhost:1883.
"""

import argparse
import json
import logging
from typing import Any, Dict, Tuple

from agent.device import config


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run the device daemon (MQTT jobs, worker, telemetry)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="YAML config file")
    p.add_argument("--broker", metavar="URL", help="mqtt://HOST:PORT or mqtts://HOST:PORT")
    p.add_argument("--device-id", metavar="ID", help="device id (default: the host name)")
    p.add_argument("--state-dir", metavar="DIR", help="journal, artifacts and work files")
    p.add_argument("--backend", choices=config.BACKEND_CHOICES, help="engine backend")
    p.add_argument("--check-config", action="store_true",
                   help="validate the configuration, print it (secrets hidden) and exit")
    p.add_argument("--json", action="store_true", help="with --check-config: print JSON")
    p.set_defaults(func=run)


def overrides(args: argparse.Namespace) -> Dict[Tuple[str, ...], Any]:
    out: Dict[Tuple[str, ...], Any] = {}
    if args.broker:
        out.update(config.parse_broker_url(args.broker))
    if args.device_id:
        out[("device_id",)] = args.device_id
    if args.state_dir:
        out[("state_dir",)] = args.state_dir
    if args.backend:
        out[("backend",)] = args.backend
    return out


def run(args: argparse.Namespace) -> int:
    cfg = config.load(args.config, overrides=overrides(args))
    if args.check_config:
        shown = cfg.to_dict()
        if args.json:
            print(json.dumps({"ok": True, "config": shown}, indent=2))
        else:
            print("config OK{}".format(" ({})".format(cfg.source) if cfg.source else ""))
            print("device {} -> broker {}:{} ({}{}), topics {}/devices/{}/...".format(
                cfg.device_id, cfg.broker.host, cfg.broker.port, cfg.broker.protocol,
                ", TLS" if cfg.broker.tls.enabled else "", cfg.topic_prefix, cfg.device_id))
            print("state {}, engine cache {}, backend {}, worker {}".format(
                cfg.state_dir, cfg.cache_dir, cfg.backend, cfg.worker_python))
        return 0
    if not getattr(args, "verbose", 0):
        # A service logs its job transitions (journald keeps them); -v adds debug output.
        logging.getLogger("agent").setLevel(logging.INFO)
    from agent.device.daemon import run_daemon

    return run_daemon(cfg)
