"""Which fleet commands the audit trail records (agent.cli.fleet_audit): the table, the
mutating-verb rule that covers commands added later, reads left out, targets, no secrets, and
``--since``."""

import pytest

from agent.cli import build_parser
from agent.cli.fleet_audit import action_of, args_of, parse_since, target_of
from agent.errors import AgentError
from agent.fleet.database.audit import clean_args


def parsed(*argv):
    argv = ["fleet"] + list(argv)
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("argv,action,target", [
    (["deploy", "det@3", "--to", "site=w3"], "deploy", "det@3"),
    (["deployments", "pause", "d3"], "deployments pause", "d3"),
    (["deployments", "retry", "d3", "--devices", "a", "b"], "deployments retry", "d3"),
    (["devices", "accept", "cam-1"], "devices accept", "cam-1"),
    (["label", "cam-1", "site=w3"], "label", "cam-1"),
    (["label", "cam-1", "--remove", "site"], "label", "cam-1"),
    (["models", "rm", "det@3"], "models rm", "det@3"),
    (["rollouts", "cancel", "ro-1"], "rollouts cancel", "ro-1"),
    (["rollback", "--device", "cam-1", "--name", "det"], "rollback", "cam-1"),
    (["cancel", "job-1"], "cancel", "job-1"),
    (["db", "upgrade"], "db upgrade", None),
])
def test_commands_that_change_the_fleet_are_recorded(argv, action, target):
    args = parsed(*argv)
    assert action_of(args) == action and target_of(args) == target


@pytest.mark.parametrize("argv", [
    ["deployments", "ls"], ["deployments", "show", "d3"], ["models", "ls"], ["label", "cam-1"],
    ["devices", "pending"], ["rollouts", "show", "ro-1"], ["db", "current"], ["audit"],
    ["keygen", "--out", "x"],
    ["rollout", "--dry-run", "--model", "m.onnx", "--precision", "fp16", "--all"]])
def test_reads_are_not_recorded(argv):
    assert action_of(parsed(*argv)) is None


def test_a_command_added_later_is_recorded_by_its_verb():
    class Args:
        command, fleet_command, action = "fleet", "deployments", "undo"

    assert action_of(Args()) == "deployments undo"  # type: ignore[arg-type]
    Args.fleet_command, Args.action = "devices", "rekey"
    assert action_of(Args()) == "devices rekey"  # type: ignore[arg-type]
    Args.fleet_command, Args.action = "pins", "ls"
    assert action_of(Args()) is None  # type: ignore[arg-type]


def test_no_secret_or_connection_detail_is_kept():
    args = parsed("rollback", "--device", "cam-1", "--password-file", "/etc/pw",
                  "--key-file", "/etc/k", "--db", "postgresql://u:pw@h/db")
    kept = clean_args(args_of(args))  # as agent.fleet.database.audit.record keeps them
    assert "password_file" not in kept and "key_file" not in kept and "db" not in kept
    assert kept["device"] == ["cam-1"]


def test_since_takes_durations_times_and_unix_times():
    assert parse_since("30m", now=10000.0) == 8200.0
    assert parse_since("2d", now=200000.0) == 200000.0 - 172800
    assert parse_since("1764237600") == 1764237600.0
    assert parse_since("2026-11-27T10:00:00") > 0
    with pytest.raises(AgentError) as err:
        parse_since("yesterday")
    assert err.value.code == "bad_argument"


def test_only_the_arguments_typed_are_kept():
    argv = ["fleet", "deploy", "det@3", "--to", "site=w3", "--id", "d3", "--percent", "10"]
    kept = args_of(parsed(*argv[1:]), argv)
    assert kept == {"ref": "det@3", "to": "site=w3", "id": "d3", "percent": 10.0}
    argv = ["fleet", "label", "cam-1", "a=b", "c=d"]
    assert args_of(parsed(*argv[1:]), argv) == {"device": "cam-1", "assignments": ["a=b", "c=d"]}
