"""agent.fleet.commands called as the CLI calls them: plain arguments in, data or AgentError
out, nothing printed (the flags' checks that need no broker or service)."""

import os

import pytest

from agent.errors import AgentError
from agent.fleet.commands import db, deploy, rollback, serve


def test_the_database_url_is_checked_before_anything_opens_it(tmp_path, capsys):
    with pytest.raises(AgentError) as e:
        db.resolve_url("mysql://x")
    assert e.value.code == "bad_argument" and "sqlite:///PATH" in e.value.message
    missing = "sqlite:///" + str(tmp_path / "typo.db")
    with pytest.raises(AgentError) as e:
        db.resolve_url(missing, existing=True)
    assert e.value.code == "file_not_found"
    assert db.resolve_url(missing) == missing  # a new database is fine where one may be made
    assert db.store_dir(None, missing) == os.path.join(str(tmp_path), "fleet-artifacts")
    assert db.store_dir("/srv/blobs", missing) == "/srv/blobs"
    assert capsys.readouterr() == ("", "")


def test_serve_refuses_tls_files_without_their_server():
    opts = serve.ServeOptions(db_url="sqlite:///x.db", http_tls_cert="c.pem")
    with pytest.raises(AgentError) as e:
        serve._http_listen(opts)
    assert e.value.code == "bad_argument" and "need --http" in e.value.message
    opts.http = ":0"
    with pytest.raises(AgentError) as e:
        serve._http_listen(opts)
    assert "go together" in e.value.message
    assert serve._http_listen(serve.ServeOptions(db_url="sqlite:///x.db")) is None


def test_a_rollback_needs_devices_or_a_rollout():
    with pytest.raises(AgentError) as e:
        rollback.run(rollback.Request(), connect=lambda: pytest.fail("connected"))
    assert e.value.code == "bad_argument"


def test_a_deployment_is_checked_before_its_database_is_opened():
    dep, selector = deploy.parse("det@3", "site=w3", None)
    assert (dep["name"], dep["version"], selector.text) == ("det", "3", "site=w3")
    assert dep["deployment_id"].startswith("det-3-")
    with pytest.raises(AgentError) as e:
        deploy.parse("det", "", None)
    assert "NAME@VERSION" in e.value.message
    version = {"name": "det", "version": "3", "defaults": {"precision": "fp16"},
               "artifacts": {"model": {"sha256": "ab" * 32, "size": 10, "name": "m.onnx"}}}
    with pytest.raises(AgentError) as e:
        deploy.build_spec(deploy.DeployOptions(), version, "d1")
    assert e.value.code == "no_accuracy_gate"
    spec = deploy.build_spec(deploy.DeployOptions(no_accuracy_gate=True, batch=2), version, "d1")
    assert (spec["precision"], spec["batch"], spec["model_name"]) == ("fp16", 2, "det")
    with pytest.raises(AgentError) as e:
        deploy.build_spec(deploy.DeployOptions(no_accuracy_gate=True, max_attempts=0),
                          version, "d1")
    assert "--max-attempts" in e.value.message
