"""agent.device.models.removal: the ``remove`` command on a real journal and models directory
(no app: no hand-off entries)."""

import os

import pytest

from agent.device.config import Config
from agent.device.journal.store import Journal
from agent.device.models.directory import ModelsDir
from agent.device.models.live_check import LiveCheck
from agent.device.models.notes import ModelNotes
from agent.device.models.removal import remove
from agent.errors import AgentError
from agent.wire import protocol


class Switch(object):
    """What model_removal reads of agent.device.models.switch.ModelSwitch."""

    def __init__(self, journal, models, pending=None, state_dir=None):
        self.journal, self.models, self.pending, self.entries = journal, models, pending, []
        self.health, self.disk_health, self.changes = {"det": "ok"}, {}, 0
        self.notes = ModelNotes(None)  # pins: a removed name's pin goes with it
        cfg = Config(state_dir=state_dir)  # the app's donated inputs go with the name too
        self.live = LiveCheck(cfg, models, lambda *event, **kw: None)

    def changed(self):
        self.changes += 1


class Pending(object):
    name, version, phase = "det", "4", "waiting"


def holding(tmp_path, pending=None):
    journal = Journal(str(tmp_path / "journal.db"))
    models = ModelsDir(str(tmp_path / "models"))
    for version in ("2", "3"):
        os.makedirs(models.version_dir("det", version))
        journal.activate_version("det", version, "a" * 64, "k" + version)
    models.set_current("det", "3")
    return Switch(journal, models, pending, str(tmp_path)), journal, models


def test_remove_forgets_every_version_and_the_directory(tmp_path):
    switch, journal, models = holding(tmp_path)
    os.makedirs(switch.live.samples.dir("det"))
    out = remove(switch, "det")
    assert out["state"] == "removed" and sorted(out["removed"]) == ["2", "3"]
    assert not os.path.exists(switch.live.samples.dir("det"))
    assert journal.model_versions("det") == [] and "det" not in models.names()
    assert not os.path.lexists(models.name_dir("det")) and switch.changes == 1
    assert "det" not in switch.health
    assert remove(switch, "det") == {"name": "det", "removed": [], "state": "absent"}


def test_a_name_mid_switch_is_refused_and_kept(tmp_path):
    switch, journal, models = holding(tmp_path, Pending())
    with pytest.raises(AgentError) as err:
        remove(switch, "det")
    assert err.value.code == "model_switching" and "version 4 waiting" in err.value.message
    assert len(journal.model_versions("det")) == 2 and models.current("det") == "3"


def test_the_command_needs_a_valid_name():
    ok = protocol.decode("command", b'{"protocol": 1, "command": "remove", "name": "det"}')
    assert ok["name"] == "det"
    for bad in (b'{"protocol": 1, "command": "remove"}',
                b'{"protocol": 1, "command": "remove", "name": "../etc"}'):
        with pytest.raises(AgentError):
            protocol.decode("command", bad)


def test_a_name_moved_aside_and_not_deleted_goes_at_the_next_start(tmp_path):
    models = ModelsDir(str(tmp_path / "models"))
    os.makedirs(models.version_dir("det", "3"))
    os.rename(models.name_dir("det"), str(tmp_path / "models" / ".removed-det-1"))  # a crash
    models.reconcile({}, {})
    assert os.listdir(str(tmp_path / "models")) == []
