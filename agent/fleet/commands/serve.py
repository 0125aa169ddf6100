"""``fleet serve``: the controller service's start-up and loop. The database upgraded (in a
child process) or refused, the ``FleetService`` built with its admission, registry blob store,
deployments and engine sharing, the HTTP(S) artifact source, the dashboard, systemd's
notifications and watchdog, SIGTERM/SIGINT as an orderly stop, and on the way out the rollouts'
leases released.
"""

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

from agent.errors import AgentError
from agent.fleet.commands import admission as admission_command
from agent.fleet.commands.db import store_dir, upgrade_in_child
from agent.fleet.database.store import Store
from agent.fleet.service import LEASE_S, FleetService
from agent.wire import job_signer, protocol

log = logging.getLogger("agent.fleet")


@dataclass
class ServeOptions:
    """``fleet serve``'s flags (docs/fleet.md; ``--help`` says what each does)."""
    db_url: str
    store: Optional[str] = None
    no_db_upgrade: bool = False
    admission: admission_command.Policy = field(default_factory=admission_command.Policy)
    instance: Optional[str] = None
    share_group: Optional[str] = None
    lease: float = LEASE_S
    http: Optional[str] = None
    http_url: Optional[str] = None
    http_tls_cert: Optional[str] = None
    http_tls_key: Optional[str] = None
    http_min_bytes: int = 1 << 20
    share_engines: bool = False
    builders: Optional[str] = None
    share_quorum: int = 1
    share_wait: float = 900.0
    signing_key: Optional[str] = None
    sequence_file: Optional[str] = None
    valid_for: float = job_signer.DEFAULT_VALIDITY_S
    dashboard: Optional[str] = None
    dashboard_token_file: Optional[str] = None
    telemetry_retention: Optional[float] = None  # days; None: the default


def serve(opts: ServeOptions, connect: Callable[[], Any], notifier: Any) -> None:
    """Run until SIGTERM or SIGINT. ``connect``: the broker connection (FleetConnection);
    ``notifier``: systemd's (agent.device.sdnotify.Notifier: ``notify``,
    ``watchdog_interval``)."""
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)  # a service says what it does with its rollouts
    signer = None
    if opts.signing_key:
        signer = job_signer.Signer(opts.signing_key, opts.sequence_file, opts.valid_for)
    url = opts.db_url
    stop = {"now": False}

    def request_stop(*_: Any) -> None:
        stop["now"] = True

    # Before the upgrade's child process: a SIGTERM during start-up is an orderly stop.
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    # An existing database is upgraded in place (or, --no-db-upgrade, refused with the command).
    if not opts.no_db_upgrade:
        upgrade_in_child(url, opts.store)
    store = Store(url, schema="require")
    dashboard = None
    conn = connect()
    conn.directory.compact = True  # the database keeps the devices' messages
    try:
        http = None
        listen = _http_listen(opts)
        service = FleetService(store, conn, signer, instance=opts.instance,
                               share_group=opts.share_group, lease_s=opts.lease,
                               http_base=None, http_min_bytes=opts.http_min_bytes,
                               admission=admission_command.make(store, opts.admission))
        _wire_parts(service, store, conn, opts)
        if listen is not None:
            http = _start_http(service, opts, listen)
        service.start()
        from agent.fleet import web

        # telemetry history; --dashboard: the dashboard
        dashboard = web.mount(url, service, opts.dashboard, opts.dashboard_token_file,
                              opts.telemetry_retention)
        notifier.notify("READY=1", "STATUS=serving {}".format(conn.url))
        log.info("fleet service %s (pid %d, MQTT client %s) on %s, database %s",
                 service.instance, os.getpid(), conn.client_id, conn.url,
                 store.url.split("@")[-1])
        last_dog = time.monotonic()
        while not stop["now"]:
            service.step()
            if notifier.watchdog_interval and time.monotonic() - last_dog >= \
                    notifier.watchdog_interval:
                notifier.notify("WATCHDOG=1")
                last_dog = time.monotonic()
        notifier.notify("STOPPING=1")
        service.drain()
        store.release(service.instance)
        if http is not None:
            http.stop()
    finally:
        conn.close()
        store.close()
        if dashboard is not None:
            dashboard.stop()


def _http_listen(opts: ServeOptions) -> Optional[Tuple[str, int, Any]]:
    """``--http`` checked with its TLS files: (host, port, TLS context or None), or None."""
    if (opts.http_tls_cert or opts.http_tls_key) and not opts.http:
        raise AgentError("bad_argument", "--http-tls-cert/--http-tls-key need --http "
                         "HOST:PORT (the server they are for); found no --http")
    if not opts.http:
        return None
    from agent.fleet.transfer.http_bounds import listen_address, server_tls_context

    tls = None
    if bool(opts.http_tls_cert) != bool(opts.http_tls_key):
        raise AgentError("bad_argument", "--http-tls-cert and --http-tls-key go "
                         "together; found only one of them")
    if opts.http_tls_cert:
        tls = server_tls_context(opts.http_tls_cert, str(opts.http_tls_key))
    host, port = listen_address(opts.http, "--http", tls=tls is not None)
    if tls is not None and opts.http_url and not opts.http_url.startswith("https://"):
        log.warning("--http-url %s is not an https:// URL while --http serves HTTPS: "
                    "devices will fail to reach it", opts.http_url)
    return host, port, tls


def _wire_parts(service: FleetService, store: Store, conn: Any, opts: ServeOptions) -> None:
    """The registry's blob store, the deployments and (``--share-engines``) engine sharing."""
    from agent.fleet.database import blobs
    from agent.fleet.deployments.deployment_runner import DeploymentRunner

    url = opts.db_url
    # The registry's blob store: the directory the database names (recorded now, from
    # --store or the default, when it names none yet).
    service.blob_root = blobs.directory(store, opts.store or (
        None if blobs.recorded(store) else store_dir(opts.store, url)), record=True)
    service.deployments = DeploymentRunner(store, service.instance, opts.lease)
    service.deployments.blob_root = service.blob_root
    service.deployments.send_command = lambda device, cmd: conn.publish(
        conn.topics.commands(device), protocol.encode(cmd))
    if opts.share_engines:
        if not opts.http:
            raise AgentError("bad_argument", "--share-engines needs --http HOST:PORT "
                             "(builders upload their engines there)")
        from agent.fleet.transfer.sharing import ShareBoard

        service.sharing = ShareBoard(store, store_dir(opts.store, url), service.server.add_file,
                                     builder_key=service.builder_key,
                                     designated=lambda d: d in service.designated_builders)
        service.share_wait_s = float(opts.share_wait)
        service.share_quorum = max(1, int(opts.share_quorum))
        service.share_builders = frozenset(
            b.strip() for b in (opts.builders or "").split(",") if b.strip())


def _start_http(service: FleetService, opts: ServeOptions,
                listen: Tuple[str, int, Any]) -> Any:
    """The artifact store over HTTP(S) (Range requests; uploads of shared engines)."""
    from agent.fleet import web
    from agent.fleet.deployments.uploads import Uploads
    from agent.fleet.transfer.http_source import HttpSource

    host, port, tls = listen
    assert service.blob_root is not None  # _wire_parts set it
    uploads = Uploads(opts.db_url, service.blob_root, web.read_token(opts.dashboard_token_file))
    http = HttpSource(host, int(port), service.server.files,
                      shares=service.sharing, tls=tls, uploads=uploads).start()
    service.http_base = (opts.http_url or "{}://{}:{}".format(
        http.scheme, "[{}]".format(host) if ":" in host else host, http.port)
    ).rstrip("/")
    log.info("artifacts of %d bytes or more also at %s/artifacts/SHA256",
             opts.http_min_bytes, service.http_base)
    return http


