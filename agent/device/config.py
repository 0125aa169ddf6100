"""The daemon's configuration: a YAML file, JETSON_AGENT_<KEY> environment overrides, then
command-line flags (each layer overrides the one before).

The schema is the dataclasses below: a nested dataclass is a YAML section, a field's type is
the type the YAML value must have. Unknown keys and wrong types are ``bad_config`` errors that
name the key and the line. Secrets never sit in the file: ``broker.password_file`` (and the TLS
key) name files, resolved against systemd's ``$CREDENTIALS_DIRECTORY`` (``LoadCredential=``)
when the name is relative.
"""

import dataclasses
import os
import re
import socket
import sys
import typing
from typing import Any, Dict, List, Mapping, Optional, Tuple
from urllib.parse import urlsplit

import yaml

from agent.errors import AgentError
from agent.fsio import state_dir as default_state_dir

ENV_PREFIX = "JETSON_AGENT_"
PROTOCOLS = ("v5", "v3.1.1")
BACKEND_CHOICES = ("auto", "onnxruntime", "tensorrt")
DEVICE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.I)

# Field metadata keys: "choices" (allowed values), "size" (accepts 512MiB etc.),
# "min" (lowest number allowed), "secret" (hidden by to_dict).


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
    password: Optional[str] = _f(None, secret=True, internal=True)  # read from password_file
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
    timeout_s: float = _f(10.0, min=0.1)  # re-request blocks that did not come (doubles to 60 s)


@dataclasses.dataclass
class SecurityConfig:
    # Ed25519 public keys job signatures may come from (files, or ed25519:BASE64 inline)
    trusted_keys: List[str] = dataclasses.field(default_factory=list)
    allow_unsigned: bool = False  # lab devices only: run unsigned job documents (diag warns)
    max_clock_skew_s: float = _f(300.0, min=0)  # tolerance on a signed job's validity window


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
    source: Optional[str] = _f(None, internal=True)  # the file it came from

    @property
    def cache_dir(self) -> str:
        # engines/ and calibration/ live here; the default matches the CLI so both share a cache
        return self.cache.dir or self.state_dir or default_state_dir()

    def to_dict(self, show_secrets: bool = False) -> Dict[str, Any]:
        return _as_dict(self, show_secrets)


def _as_dict(obj: Any, show_secrets: bool) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            out[field.name] = _as_dict(value, show_secrets)
        elif field.metadata.get("secret"):
            if value is not None:
                out[field.name] = value if show_secrets else "***"
        else:
            out[field.name] = value
    return out


def sanitize_device_id(name: str) -> str:
    """A host name made fit for an MQTT topic level and a client id."""
    cleaned = re.sub(r"[^a-z0-9_.-]+", "-", name.strip().lower()).strip("-.")
    return (cleaned or "jetson")[:64]


def parse_size(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise AgentError("bad_config", "{} expects a size, found {!r}".format(where, value))
    if isinstance(value, int):
        return value
    m = SIZE_RE.match(str(value))
    if not m:
        raise AgentError("bad_config", "{} expects a size such as 1048576, 512MiB or 2GB, "
                                       "found {!r}".format(where, value))
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary else 1000
    return int(number * base ** " KMGT".index(unit or " "))


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


# --- reading the YAML with line numbers -------------------------------------------------------

def _line_index(node: Any, path: Tuple[str, ...], out: Dict[Tuple[str, ...], int]) -> None:
    """path -> 1-based line of the key (or of the document for the root)."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                sub = path + (str(key_node.value),)
                out[sub] = key_node.start_mark.line + 1
                _line_index(value_node, sub, out)


def _read_yaml(path: str) -> Tuple[Any, Dict[Tuple[str, ...], int]]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise AgentError("bad_config", "cannot read config file {}: {}".format(
            path, exc.strerror or exc))
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = " line {}".format(mark.line + 1) if mark is not None else ""
        raise AgentError("bad_config", "{}{}: not valid YAML: {}".format(
            path, where, getattr(exc, "problem", None) or exc))
    lines: Dict[Tuple[str, ...], int] = {}
    if node is not None:
        _line_index(node, (), lines)
    return data, lines


# --- validation against the dataclass schema --------------------------------------------------

def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "mapping", type(None): "null"}.get(type(value), type(value).__name__)


def _expected_name(tp: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp))


def _unwrap_optional(tp: Any) -> Tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        return [a for a in args if a is not type(None)][0], True
    return tp, False


def _check_value(field: "dataclasses.Field[Any]", tp: Any, value: Any, where: str) -> Any:
    base, optional = _unwrap_optional(tp)
    meta = field.metadata
    if typing.get_origin(base) is list:  # a list of strings; one string is a list of one
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise AgentError("bad_config", "{} expects a list of strings, found {} {!r}".format(
                where, _type_name(value), value))
        return list(items)
    if value is None:
        if optional:
            return None
        raise AgentError("bad_config", "{} expects {}, found null".format(
            where, _expected_name(base)))
    if meta.get("size"):
        value = parse_size(value, where)
    elif base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif base is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # e.g. a numeric device id
    if not isinstance(value, base) or (base is not bool and isinstance(value, bool)):
        raise AgentError("bad_config", "{} expects {}, found {} {!r}".format(
            where, _expected_name(base), _type_name(value), value))
    if "choices" in meta and value not in meta["choices"]:
        raise AgentError("bad_config", "{} must be one of {}, found {!r}".format(
            where, ", ".join(meta["choices"]), value))
    if "min" in meta and value < meta["min"]:
        raise AgentError("bad_config", "{} must be >= {}, found {!r}".format(
            where, meta["min"], value))
    if "max" in meta and value > meta["max"]:
        raise AgentError("bad_config", "{} must be <= {}, found {!r}".format(
            where, meta["max"], value))
    return value


def _hints(cls: Any) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _apply(obj: Any, data: Any, path: Tuple[str, ...], describe: Any) -> None:
    """Set the fields of ``obj`` from mapping ``data``; ``describe(path)`` says where a key is."""
    if not isinstance(data, dict):
        raise AgentError("bad_config", "{} expects a mapping, found {} {!r}".format(
            describe(path) if path else "the config file", _type_name(data), data))
    fields = {f.name: f for f in dataclasses.fields(obj) if not f.metadata.get("internal")}
    hints = _hints(type(obj))
    for key, value in data.items():
        sub = path + (str(key),)
        if key == "password" and path == ("broker",):
            raise AgentError("bad_config", "{}: broker.password is not accepted: put the secret "
                                           "in a file and name it in broker.password_file".format(
                                               describe(sub)))
        if key not in fields:
            raise AgentError("bad_config", "{}: unknown key {!r}; expected one of {}".format(
                describe(sub), ".".join(sub), ", ".join(sorted(fields))))
        field = fields[key]
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            _apply(getattr(obj, key), value if value is not None else {}, sub, describe)
        else:
            setattr(obj, key, _check_value(field, tp, value, describe(sub)))


def _leaf_paths(cls: Any, prefix: Tuple[str, ...] = ()) -> List[Tuple[str, ...]]:
    out: List[Tuple[str, ...]] = []
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        if field.metadata.get("internal"):
            continue
        tp = hints[field.name]
        if dataclasses.is_dataclass(tp):
            out += _leaf_paths(tp, prefix + (field.name,))
        else:
            out.append(prefix + (field.name,))
    return out


def env_name(path: Tuple[str, ...]) -> str:
    return ENV_PREFIX + "_".join(path).upper()


def _env_overrides(env: Mapping[str, str]) -> Dict[Tuple[str, ...], Tuple[Any, str]]:
    """Known JETSON_AGENT_<KEY> variables -> (value, variable name). Other JETSON_AGENT_*
    variables are left alone (tools share the prefix)."""
    out: Dict[Tuple[str, ...], Tuple[Any, str]] = {}
    for path in _leaf_paths(Config):
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


def _nest(path: Tuple[str, ...], value: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {path[-1]: value}
    for key in reversed(path[:-1]):
        out = {key: out}
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
        data, lines = _read_yaml(path)
        base_dir = os.path.dirname(os.path.abspath(path))

        def in_file(p: Tuple[str, ...]) -> str:
            line = lines.get(p)
            return "{} line {}: {}".format(path, line, ".".join(p)) if line else ".".join(p)

        if data is not None:
            _apply(cfg, data, (), in_file)
        cfg.source = os.path.abspath(path)
    for p, (value, name) in _env_overrides(env).items():
        _apply(cfg, _nest(p, value), (), lambda q, name=name: "{} ({})".format(
            name, ".".join(q)))
    for p, value in (overrides or {}).items():
        _apply(cfg, _nest(p, value), (), lambda q: "command-line override of " + ".".join(q))
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
    cfg.security.trusted_keys = [_trusted_key(k, base_dir) for k in cfg.security.trusted_keys]
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
    return cfg


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
