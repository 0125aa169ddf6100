"""``--db`` typos are errors that name what was looked at (exit 2), never a new empty database
or a SQLite file named after another database's URL."""

import os

import pytest

from tests.integration.test_fleet_service import fleet_cli


@pytest.mark.parametrize("command", [["rollouts", "ls"], ["rollouts", "show", "r1"],
                                     ["devices"], ["jobs"], ["deploy", "det@1", "--to", "a=b"],
                                     ["deploy", "det@1", "--to", "a=b", "--dry-run"],
                                     ["deployments", "ls"], ["label", "cam-1", "a=b"],
                                     ["devices", "accept", "cam-1"], ["db", "current"]])
def test_a_missing_sqlite_database_is_refused_by_the_commands_that_read_it(tmp_path, command):
    db = tmp_path / "typo" / "fleet.db"
    out = fleet_cli(command + ["--db", "sqlite:///" + str(db)])
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "no fleet database at " + str(db) in out.stderr
    assert "file_not_found" in out.stderr
    assert not os.path.exists(str(db)) and not os.path.exists(str(db.parent))


@pytest.mark.parametrize("url", ["mysql://x/y", "fleet.db", "http://localhost/db"])
def test_an_unknown_scheme_is_refused_with_what_is_expected(tmp_path, url):
    out = fleet_cli(["rollouts", "ls", "--db", url])
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--db expects sqlite:///PATH or postgresql://" in out.stderr
    assert os.listdir(str(tmp_path)) in ([], ["admission-keys"])  # the fixture's keys file
    assert not os.path.exists("mysql:")
