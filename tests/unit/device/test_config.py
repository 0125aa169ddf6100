"""agent.device.config: defaults, file, env and flag layers; errors that name key and line."""

import pytest

from agent.device import config, config_schema
from agent.errors import AgentError


def write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load(path=None, env=None, overrides=None):
    return config.load(path, overrides=overrides, env=env or {})


def test_defaults_serve_a_local_broker(tmp_path):
    cfg = load()
    assert (cfg.broker.host, cfg.broker.port, cfg.broker.protocol) == ("localhost", 1883, "v5")
    assert cfg.device_id and config.DEVICE_ID_RE.match(cfg.device_id)
    assert cfg.backend == "auto" and cfg.topic_prefix == "jetson-agent"
    assert cfg.worker_python
    assert cfg.state_dir.endswith("state")  # tests' JETSON_AGENT_STATE_DIR via fsio rule


def test_full_file(tmp_path):
    (tmp_path / "pw").write_text("s3cret\n")
    path = write(tmp_path, """
device_id: nano-07
topic_prefix: /fleet/
backend: onnxruntime
telemetry_interval: 5
broker:
  host: broker.local
  port: 8883
  protocol: v3.1.1
  username: nano-07
  password_file: pw
  keepalive: 20
limits:
  max_message_bytes: 256KiB
  job_timeout_s: 600
cache:
  engine_budget_bytes: 1.5GB
""")
    cfg = load(path)
    assert cfg.device_id == "nano-07" and cfg.topic_prefix == "fleet"
    assert cfg.broker.password == "s3cret" and cfg.broker.password_file == str(tmp_path / "pw")
    assert cfg.limits.max_message_bytes == 256 * 1024
    assert cfg.limits.job_timeout_s == 600.0
    assert cfg.cache.engine_budget_bytes == 1_500_000_000
    assert cfg.telemetry_interval == 5.0
    shown = cfg.to_dict()
    assert shown["broker"]["password"] == "***"
    assert cfg.source == path


def test_unknown_key_names_key_and_line(tmp_path):
    path = write(tmp_path, "device_id: a\nbroker:\n  host: x\n  prot: v5\n")
    with pytest.raises(AgentError) as exc:
        load(path)
    assert exc.value.code == "bad_config"
    assert "line 4" in exc.value.message and "broker.prot" in exc.value.message
    assert "protocol" in exc.value.message  # lists what is allowed


def test_wrong_type_names_key_expected_and_found(tmp_path):
    path = write(tmp_path, "broker:\n  port: eighteen\n")
    with pytest.raises(AgentError) as exc:
        load(path)
    msg = exc.value.message
    assert "line 2" in msg and "broker.port" in msg and "an integer" in msg and "eighteen" in msg


@pytest.mark.parametrize("text,needle", [
    ("broker:\n  protocol: v4\n", "v5, v3.1.1"),
    ("broker:\n  port: 70000\n", "<= 65535"),
    ("backend: cuda\n", "auto, onnxruntime, tensorrt"),
    ("limits:\n  max_store_bytes: lots\n", "a size"),
    ("device_id: 'a/b'\n", "device_id"),
    ("topic_prefix: 'a/#'\n", "topic_prefix"),
    ("broker: 5\n", "expects a mapping"),
    ("- a\n- b\n", "expects a mapping"),
    ("broker:\n  password: hunter2\n", "password_file"),
    ("broker:\n  tls:\n    enabled: yes please\n", "a boolean"),
    ("a: [\n", "not valid YAML"),
    ("models:\n  app_names:\n    root: [Det]\n", "models.app_names.root: expected a model"),
    ("models:\n  app_names:\n    no-such-user-x: [det]\n", "expected a user"),
    ("models:\n  app_names:\n    '@no-such-group-x': [det]\n", "expected a group"),
    ("models:\n  app_names:\n    root: {det: 1}\n", "a list of at most 256"),
    ("models:\n  unconfirmed_retries: 9\n", "<= 5"),
])
def test_bad_values(tmp_path, text, needle):
    with pytest.raises(AgentError) as exc:
        load(write(tmp_path, text))
    assert exc.value.code == "bad_config"
    assert needle in exc.value.message


def test_missing_file_and_unreadable_secret(tmp_path):
    with pytest.raises(AgentError) as exc:
        load(str(tmp_path / "nope.yaml"))
    assert exc.value.code == "bad_config" and "nope.yaml" in exc.value.message
    path = write(tmp_path, "broker:\n  username: u\n  password_file: missing\n")
    with pytest.raises(AgentError) as exc:
        load(path)
    assert "missing" in exc.value.message


def test_credentials_directory(tmp_path):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "mqtt-password").write_text("from-systemd")
    path = write(tmp_path, "broker:\n  username: dev\n  password_file: mqtt-password\n")
    cfg = load(path, env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert cfg.broker.password == "from-systemd"


def test_env_overrides_file_and_flags_override_env(tmp_path):
    path = write(tmp_path, "broker:\n  port: 1000\ndevice_id: from-file\n")
    env = {"JETSON_AGENT_BROKER_PORT": "2000", "JETSON_AGENT_DEVICE_ID": "from-env",
           "JETSON_AGENT_LIMITS_JOB_TIMEOUT_S": "12", "JETSON_AGENT_VENV": "/ignored"}
    cfg = load(path, env=env)
    assert cfg.broker.port == 2000 and cfg.device_id == "from-env"
    assert cfg.limits.job_timeout_s == 12.0
    cfg = load(path, env=env, overrides={("broker", "port"): 3000})
    assert cfg.broker.port == 3000
    with pytest.raises(AgentError) as exc:
        load(path, env={"JETSON_AGENT_BROKER_PORT": "x"})
    assert "JETSON_AGENT_BROKER_PORT" in exc.value.message


def test_broker_url():
    assert config.parse_broker_url("mqtt://10.0.0.2:1884") == {
        ("broker", "host"): "10.0.0.2", ("broker", "port"): 1884}
    over = config.parse_broker_url("mqtts://b.example")
    assert over[("broker", "port")] == 8883 and over[("broker", "tls", "enabled")] is True
    assert config.parse_broker_url("localhost")[("broker", "port")] == 1883
    with pytest.raises(AgentError):
        config.parse_broker_url("http://x:1")


def test_sanitize_device_id():
    assert config.sanitize_device_id("Jetson Nano #3.local") == "jetson-nano-3.local"
    assert config.sanitize_device_id("///") == "jetson"


def test_sizes():
    assert config_schema.parse_size("512MiB", "x") == 512 << 20
    assert config_schema.parse_size("2GB", "x") == 2_000_000_000
    assert config_schema.parse_size(10, "x") == 10
    with pytest.raises(AgentError):
        config_schema.parse_size(True, "x")


def test_tls_files_resolved_and_checked(tmp_path):
    (tmp_path / "ca.pem").write_text("x")
    cfg = load(write(tmp_path, "broker:\n  tls:\n    ca_file: ca.pem\n"))
    assert cfg.broker.tls.enabled and cfg.broker.tls.ca_file == str(tmp_path / "ca.pem")
    with pytest.raises(AgentError) as exc:
        load(write(tmp_path, "broker:\n  tls:\n    cert_file: ca.pem\n"))
    assert "together" in exc.value.message


def test_example_yaml_loads_back(tmp_path):
    text = config.example_yaml()
    cfg = load(write(tmp_path, text.replace("device_id: null", "device_id: x")))
    assert cfg.device_id == "x"


def test_app_names_and_unconfirmed_retries(tmp_path):
    cfg = load()
    assert cfg.models.app_names == {} and cfg.models.unconfirmed_retries == 1
    cfg = load(write(tmp_path, "models:\n  unconfirmed_retries: 0\n  app_names:\n"
                               "    root: det\n    '@root': ['*']\n"))
    assert cfg.models.app_names == {"root": ["det"], "@root": ["*"]}
    assert cfg.models.unconfirmed_retries == 0
