"""The daemon's configuration: a YAML file, JETSON_AGENT_<KEY> environment overrides, then
command-line flags (each layer overrides the one before).

The schema is the dataclasses below: a nested dataclass is a YAML section, a field's type is
the type the YAML value must have (read and checked by ``config_schema``). Unknown keys and
wrong types are ``bad_config`` errors that name the key and the line. Secrets never sit in the
file: ``broker.password_file`` (and the TLS key) name files, resolved against systemd's
``$CREDENTIALS_DIRECTORY`` (``LoadCredential=``) when the name is relative.
"""

import dataclasses
import os
import re
import socket
import sys
from typing import Any, Dict, List, Mapping, Optional, Tuple
from urllib.parse import urlsplit

import yaml

from agent.device.config_schema import apply, as_dict, leaf_paths, nest, read_yaml
from agent.errors import AgentError
from agent.fsio import state_dir as default_state_dir

ENV_PREFIX = "JETSON_AGENT_"
PROTOCOLS = ("v5", "v3.1.1")
BACKEND_CHOICES = ("auto", "onnxruntime", "tensorrt")
DEVICE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# Field metadata: see agent.device.config_schema (choices, size, min, max, secret, internal).


def _f(default: Any, **meta: Any) -> Any:
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class TlsConfig:
    enabled: bool = False
    ca_file: Optional[str] = None  # None with enabled: the system's CA bundle
    cert_file: Optional[str] = None  # client certificate (mutual TLS)
    key_file: Optional[str] = None
    insecure: bool = False  # skip host-name verification (test brokers only)


@dataclasses.dataclass
class BrokerConfig:
    host: str = "localhost"
    port: int = _f(1883, min=1, max=65535)
    protocol: str = _f("v5", choices=PROTOCOLS)
    keepalive: int = _f(30, min=5)
    session_expiry: int = _f(7 * 24 * 3600, min=0)  # seconds the broker keeps our session
    username: Optional[str] = None
    password_file: Optional[str] = None
    password: Optional[str] = _f(  # read from password_file
        None, secret=True, internal=True,
        refused="put the secret in a file and name it in broker.password_file")
    reconnect_min: float = _f(1.0, min=0.05)
    reconnect_max: float = _f(30.0, min=0.1)
    tls: TlsConfig = dataclasses.field(default_factory=TlsConfig)


@dataclasses.dataclass
class CacheConfig:
    dir: Optional[str] = None  # engines/ + calibration/; None: $CACHE_DIRECTORY, else <state_dir>
    engine_budget_bytes: int = _f(4 << 30, size=True, min=0)


@dataclasses.dataclass
class LimitsConfig:
    max_message_bytes: int = _f(1 << 20, size=True, min=1024)
    max_artifact_bytes: int = _f(2 << 30, size=True, min=1)
    max_store_bytes: int = _f(8 << 30, size=True, min=1)
    max_partial_age_s: float = _f(24 * 3600.0, min=0)  # idle partial downloads: reclaimed
    job_timeout_s: float = _f(3600.0, min=1)
    jobs_per_minute: float = _f(60.0, min=0)  # new jobs accepted (token bucket); 0: no limit
    job_burst: int = _f(30, min=1)
    # What one .npz/.npy/JSON artifact may inflate to: inflate_ratio x its size, at least
    # inflate_min_bytes, at most max_data_bytes (also the most one generated input may take).
    inflate_ratio: int = _f(32, min=1)
    inflate_min_bytes: int = _f(64 << 20, size=True, min=0)
    max_data_bytes: int = _f(1 << 30, size=True, min=1)
    # The worker's memory ceiling (RLIMIT_DATA); 0: three quarters of the device's memory.
    worker_memory_bytes: int = _f(0, size=True, min=0)


@dataclasses.dataclass
class TransferConfig:
    block_size: int = _f(128 * 1024, size=True, min=1024, max=1024 * 1024)
    window: int = _f(64, min=1, max=1024)  # blocks requested and not yet received
    timeout_s: float = _f(10.0, min=0.1)  # re-request blocks that did not come (doubles to 8 s)
    # The CA that verifies HTTPS artifact URLs and the engine upload URL (fleet serve --http
    # with --http-tls-cert). None: broker.tls.ca_file when set, else the system's CAs.
    http_ca_file: Optional[str] = None


@dataclasses.dataclass
class SecurityConfig:
    # Ed25519 public keys job signatures may come from (files, or ed25519:BASE64 inline)
    trusted_keys: List[str] = dataclasses.field(default_factory=list)
    allow_unsigned: bool = False  # lab devices only: run unsigned job documents (diag warns)
    max_clock_skew_s: float = _f(300.0, min=0)  # tolerance on a signed job's validity window
    # This device's own Ed25519 key (docs/security.md, "Device identity"): it signs every
    # report. None: device.key beside the config file. Kept outside the state directory.
    device_key: Optional[str] = None
    # Make the key at start-up when it does not exist (else a missing configured key stops
    # the daemon: device_key_unreadable); install-jetson makes it instead.
    create_device_key: bool = False


@dataclasses.dataclass
class LiveCheckConfig:
    """The app's donated inputs and what is checked on them (docs/using-models.md)."""
    enabled: bool = True  # the live check before commit and the INT8 range watch
    keep: int = _f(256, min=1, max=65536)  # samples kept per name (a ring: oldest go first)
    keep_bytes: int = _f(64 << 20, size=True, min=1 << 16, max=1 << 30)  # per name
    min_samples: int = _f(16, min=1, max=65536)  # fewer: the live check is skipped, said so
    # A candidate passes when classifier-like outputs agree on top-1 at least this often and,
    # when max_error is set, error_stat(|candidate - running|) of every output is at most it.
    min_agreement: float = _f(0.95, min=0, max=1)
    max_error: float = _f(0.0, min=0)  # 0: not checked (classifier outputs have agreement)
    error_stat: str = _f("mean", choices=("max", "mean", "median"))
    # INT8 versions: the share of activations outside the calibrated range above which the
    # name has the calibration_stale problem; checked every every_s on the donated inputs.
    max_clip_rate: float = _f(0.01, min=0, max=1)
    # Inputs whose histogram distance from the calibration set's (0 same, 1 disjoint), beyond
    # what sampling alone gives, exceeds this drifted: calibration_stale too. 0: not checked.
    max_drift: float = _f(0.25, min=0, max=1)
    every_s: float = _f(300.0, min=1)


@dataclasses.dataclass
class ModelsConfig:
    dir: Optional[str] = None  # None: $JETSON_AGENT_MODELS_DIR (unit), else <state_dir>/models
    group: Optional[str] = None  # the app's group: files 0640, directories 0750 in it
    keep_versions: int = _f(2, min=2, max=16)  # per name, the active one included
    commit_timeout_s: float = _f(300.0, min=1, max=24 * 3600)
    # A command that says the new version works (exit 0), retried until the commit timeout.
    probe: List[str] = dataclasses.field(default_factory=list)
    probe_timeout_s: float = _f(30.0, min=1, max=3600)  # one probe run
    # The models whose app confirms (["*"]: all): a new version of one stays pending until the
    # app reports it healthy or commits it.
    app_confirms: List[str] = dataclasses.field(default_factory=list)
    # A commit window that closes with no answer (the app absent, the agent down) reopens this
    # many times before the version is rolled back as unconfirmed.
    unconfirmed_retries: int = _f(1, min=0, max=5)
    app_users: List[str] = dataclasses.field(default_factory=list)  # may use the app socket
    app_group: Optional[str] = None
    # Which names each app may commit, report on or roll back: {user | "@group": [names] |
    # ["*"]}. Empty: every allowed app, every name (root and the service user: always all).
    app_names: Dict[str, Any] = _f(None, mapping=True)
    socket: Optional[str] = None  # None: $JETSON_AGENT_SOCKET (unit), else <state_dir>/app.sock
    live_check: LiveCheckConfig = dataclasses.field(default_factory=LiveCheckConfig)


@dataclasses.dataclass
class BuilderConfig:
    # Bytes a TensorRT build's memory pools may take (WORKSPACE, TACTIC_DRAM); None: half the
    # RAM on a board whose GPU shares it (Jetson), no cap on a discrete GPU; 0: no cap.
    memory_limit: Optional[int] = _f(None, size=True, min=0)


@dataclasses.dataclass
class Config:
    device_id: Optional[str] = None  # None: the host name, sanitised
    topic_prefix: str = "jetson-agent"
    state_dir: Optional[str] = None  # None: agent.fsio.state_dir() (systemd StateDirectory)
    backend: str = _f("auto", choices=BACKEND_CHOICES)
    worker_python: Optional[str] = None  # None: the daemon's own interpreter
    telemetry_interval: float = _f(30.0, min=0.5)
    platform_root: str = "/"
    broker: BrokerConfig = dataclasses.field(default_factory=BrokerConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    limits: LimitsConfig = dataclasses.field(default_factory=LimitsConfig)
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)
    models: ModelsConfig = dataclasses.field(default_factory=ModelsConfig)
    builder: BuilderConfig = dataclasses.field(default_factory=BuilderConfig)
    # Hand-off adapters: [{type: triton|deepstream|command, models: ["*"] | [names], ...}]
    handoff: List[Dict[str, Any]] = _f(None, entries=True)
    # What this device says of itself (site: warehouse-3, camera: dock): reported in the birth
    # status (platform.labels); agent.wire.device_labels' syntax and caps.
    labels: Dict[str, str] = _f(None, mapping=True)
    source: Optional[str] = _f(None, internal=True)  # the file it came from

    @property
    def models_dir(self) -> str:
        # The unit sets the variables the client library reads (docs/using-models.md).
        return self.models.dir or os.environ.get("JETSON_AGENT_MODELS_DIR") or os.path.join(
            self.state_dir or default_state_dir(), "models")

    @property
    def app_socket(self) -> str:
        return self.models.socket or os.environ.get("JETSON_AGENT_SOCKET") or os.path.join(
            self.state_dir or default_state_dir(), "app.sock")

    @property
    def cache_dir(self) -> str:
        # engines/ and calibration/ live here; the default matches the CLI so both share a cache
        return self.cache.dir or self.state_dir or default_state_dir()

    def to_dict(self, show_secrets: bool = False) -> Dict[str, Any]:
        return as_dict(self, show_secrets)


def sanitize_device_id(name: str) -> str:
    """A host name made fit for an MQTT topic level and a client id."""
    cleaned = re.sub(r"[^a-z0-9_.-]+", "-", name.strip().lower()).strip("-.")
    return (cleaned or "jetson")[:64]


def parse_broker_url(url: str) -> Dict[Tuple[str, ...], Any]:
    """``mqtt://HOST:PORT`` / ``mqtts://HOST:PORT`` -> overrides of broker.host/port/tls."""
    parts = urlsplit(url if "://" in url else "mqtt://" + url)
    if parts.scheme not in ("mqtt", "mqtts", "tcp", "ssl") or not parts.hostname:
        raise AgentError("bad_config", "--broker expects mqtt://HOST:PORT or mqtts://HOST:PORT, "
                                       "found {!r}".format(url))
    tls = parts.scheme in ("mqtts", "ssl")
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError:
        raise AgentError("bad_config", "--broker port must be 1..65535, found {!r}".format(url))
    out: Dict[Tuple[str, ...], Any] = {("broker", "host"): parts.hostname,
                                       ("broker", "port"): port}
    if tls:
        out[("broker", "tls", "enabled")] = True
    return out


def env_name(path: Tuple[str, ...]) -> str:
    return ENV_PREFIX + "_".join(path).upper()


def _env_overrides(env: Mapping[str, str]) -> Dict[Tuple[str, ...], Tuple[Any, str]]:
    """Known JETSON_AGENT_<KEY> variables -> (value, variable name). Other JETSON_AGENT_*
    variables are left alone (tools share the prefix)."""
    out: Dict[Tuple[str, ...], Tuple[Any, str]] = {}
    for path in leaf_paths(Config):
        name = env_name(path)
        if name in env:
            raw = env[name]
            try:
                value = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                value = raw
            if isinstance(value, (dict, list)):
                value = raw
            out[path] = (value, name)
    return out


def _resolve_secret_path(name: Optional[str], base_dir: Optional[str],
                         env: Mapping[str, str]) -> Optional[str]:
    if not name:
        return None
    name = os.path.expanduser(name)
    if os.path.isabs(name):
        return name
    creds = env.get("CREDENTIALS_DIRECTORY")
    if creds:
        return os.path.join(creds, name)
    return os.path.join(base_dir or os.getcwd(), name)


def _read_secret(path: str, key: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip("\r\n")
    except OSError as exc:
        raise AgentError("bad_config", "{} names {}, which cannot be read: {}".format(
            key, path, exc.strerror or exc))


def load(
    path: Optional[str] = None,
    overrides: Optional[Dict[Tuple[str, ...], Any]] = None,
    env: Optional[Mapping[str, str]] = None,
) -> Config:
    """Defaults, then the file at ``path`` (if any), then JETSON_AGENT_* variables, then
    ``overrides`` (command-line flags, keyed by path such as ("broker", "port"))."""
    env = os.environ if env is None else env
    cfg = Config()
    base_dir = None
    if path:
        data, lines = read_yaml(path)
        base_dir = os.path.dirname(os.path.abspath(path))

        def in_file(p: Tuple[str, ...]) -> str:
            line = lines.get(p)
            return "{} line {}: {}".format(path, line, ".".join(p)) if line else ".".join(p)

        if data is not None:
            apply(cfg, data, (), in_file)
        cfg.source = os.path.abspath(path)
    for p, (value, name) in _env_overrides(env).items():
        apply(cfg, nest(p, value), (), lambda q, name=name: "{} ({})".format(
            name, ".".join(q)))
    for p, value in (overrides or {}).items():
        apply(cfg, nest(p, value), (), lambda q: "command-line override of " + ".".join(q))
    return _finish(cfg, base_dir, env)


def _finish(cfg: Config, base_dir: Optional[str], env: Mapping[str, str]) -> Config:
    if cfg.device_id is None:
        cfg.device_id = sanitize_device_id(socket.gethostname())
    elif not DEVICE_ID_RE.match(cfg.device_id):
        raise AgentError("bad_config", "device_id must be 1-64 letters, digits, '_', '.' or '-' "
                                       "(an MQTT topic level), found {!r}".format(cfg.device_id))
    prefix = cfg.topic_prefix.strip("/")
    if not prefix or any(c in prefix for c in "+#\0"):
        raise AgentError("bad_config", "topic_prefix must be a non-empty topic without '+' or "
                                       "'#', found {!r}".format(cfg.topic_prefix))
    cfg.topic_prefix = prefix
    if cfg.broker.reconnect_max < cfg.broker.reconnect_min:
        raise AgentError("bad_config", "broker.reconnect_max ({}) must be >= broker."
                                       "reconnect_min ({})".format(cfg.broker.reconnect_max,
                                                                   cfg.broker.reconnect_min))
    cfg.state_dir = default_state_dir(cfg.state_dir) if cfg.state_dir else default_state_dir()
    if cfg.cache.dir is None and env.get("CACHE_DIRECTORY"):
        cfg.cache.dir = env["CACHE_DIRECTORY"].split(":")[0]
    if cfg.cache.dir:
        cfg.cache.dir = os.path.abspath(os.path.expanduser(cfg.cache.dir))
    cfg.worker_python = cfg.worker_python or sys.executable
    _finish_models(cfg)
    cfg.security.trusted_keys = [_trusted_key(k, base_dir) for k in cfg.security.trusted_keys]
    if cfg.security.device_key:
        key = os.path.expanduser(cfg.security.device_key)
        cfg.security.device_key = key if os.path.isabs(key) or not base_dir else \
            os.path.join(base_dir, key)
    broker = cfg.broker
    broker.password_file = _resolve_secret_path(broker.password_file, base_dir, env)
    if broker.password_file:
        broker.password = _read_secret(broker.password_file, "broker.password_file")
        if broker.username is None:
            raise AgentError("bad_config", "broker.password_file is set but broker.username is "
                                           "not: a password needs a user name")
    tls = broker.tls
    for key in ("ca_file", "cert_file", "key_file"):
        resolved = _resolve_secret_path(getattr(tls, key), base_dir, env)
        if resolved is not None and not os.access(resolved, os.R_OK):
            raise AgentError("bad_config", "broker.tls.{} names {}, which cannot be read".format(
                key, resolved))
        setattr(tls, key, resolved)
    if (tls.cert_file is None) != (tls.key_file is None):
        raise AgentError("bad_config", "broker.tls.cert_file and broker.tls.key_file go together "
                                       "(mutual TLS); found only one of them")
    if tls.ca_file or tls.cert_file:
        tls.enabled = True
    http_ca = _resolve_secret_path(cfg.transfer.http_ca_file, base_dir, env)
    if http_ca is not None and not os.access(http_ca, os.R_OK):
        raise AgentError("bad_config", "transfer.http_ca_file names {}, which cannot be read"
                         .format(http_ca))
    cfg.transfer.http_ca_file = http_ca
    return cfg


def http_ca_file(cfg: Config) -> Optional[str]:
    """The CA file that verifies the fleet service's HTTPS server (artifacts, engine uploads):
    transfer.http_ca_file, else broker.tls.ca_file, else None (the system's CAs)."""
    return cfg.transfer.http_ca_file or cfg.broker.tls.ca_file or None


def _check_app_names(app_names: Dict[str, Any]) -> None:
    """``models.app_names``: user or @group -> a list of model names (or "*"), bounded."""
    from agent.wire.model_names import name_list

    if len(app_names) > 64:
        raise AgentError("bad_config", "models.app_names: expected at most 64 users and "
                         "groups, found {}".format(len(app_names)))
    for who, names in app_names.items():
        where = "models.app_names.{}".format(who)
        app_names[who] = name_list(names, where, empty=True)
        if who.startswith("@"):
            _check_account(where, who[1:], "getgrnam")
        else:
            _check_account(where, who, "getpwnam")


def _finish_models(cfg: Config) -> None:
    """The models section and the hand-off list, checked now (bad_config naming the key)."""
    from agent.device import handoff
    from agent.device.handoff.command import check_argv

    m = cfg.models
    if m.dir:
        m.dir = os.path.abspath(os.path.expanduser(m.dir))
    if m.socket:
        m.socket = os.path.abspath(os.path.expanduser(m.socket))
    if m.probe:
        m.probe = check_argv(m.probe, "models.probe")
    for user in m.app_users:
        _check_account("models.app_users", user, "getpwnam")
    if m.app_group:
        _check_account("models.app_group", m.app_group, "getgrnam")
    m.app_names = m.app_names or {}
    _check_app_names(m.app_names)
    if m.group:
        _check_account("models.group", m.group, "getgrnam")
    cfg.handoff = cfg.handoff or []
    from agent.wire.device_labels import check_labels

    try:
        cfg.labels = check_labels(cfg.labels or {}, "labels")
    except AgentError as exc:
        raise AgentError("bad_config", exc.message)
    handoff.parse(cfg.handoff, "handoff")  # checked now; the daemon parses it again


def _check_account(where: str, name: str, lookup: str) -> None:
    import grp
    import pwd

    if name.isdigit():
        return
    try:
        getattr(pwd if lookup == "getpwnam" else grp, lookup)(name)
    except KeyError:
        raise AgentError("bad_config", "{}: expected a {} of this system, found {!r}".format(
            where, "user" if lookup == "getpwnam" else "group", name))


def _trusted_key(entry: str, base_dir: Optional[str]) -> str:
    """A security.trusted_keys entry, checked now (bad_config naming it); a relative file
    name is resolved against the config file's directory."""
    from agent.wire.signing import load_trusted_key

    load_trusted_key(entry, base_dir)
    path = os.path.expanduser(entry.strip())
    if base_dir and not os.path.isabs(path) and os.path.isfile(os.path.join(base_dir, path)):
        return os.path.join(base_dir, path)
    return os.path.abspath(path) if os.path.isfile(path) else entry.strip()


def example_yaml() -> str:
    """Every key with its default (what docs/daemon.md shows)."""
    d = Config().to_dict()
    d.pop("source", None)
    d["broker"].pop("password", None)
    return yaml.safe_dump(d, sort_keys=False)
