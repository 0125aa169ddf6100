"""The fault suite's fixtures: signing keys (a trusted and a rogue one), the controller's
signer, and ``fleet``: a controller and a factory of started, signing-required daemons, each
stopped and folded into the report at the end."""


import pytest

from agent.wire import job_signer
from tests.integration.faults.suite import MUST_BE_ZERO, REPORT, finish, started


@pytest.fixture(scope="module", autouse=True)
def zeros_after_each_file():
    """Each scenario file asserts the suite's zeros when it ends, so one file run alone (or a
    ``-k`` selection) still checks them; test_faults_report prints the whole suite's figures."""
    yield
    assert {key: REPORT[key] for key in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, 0)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("signing")
    trusted = job_signer.generate_keypair(str(d), "fleet")
    rogue = job_signer.generate_keypair(str(d), "rogue")
    return {"trusted": trusted, "rogue": rogue, "dir": str(d),
            "security": "  trusted_keys: [{}]\n".format(trusted["public_key"])}


@pytest.fixture
def signer(keys, tmp_path):
    return job_signer.Signer(keys["trusted"]["private_key"], str(tmp_path / "sequence.json"))


@pytest.fixture
def fleet(mosquitto, agent_factory, keys, signer):
    """(controller signing with the trusted key, make_agent(**kw) -> started agent)."""
    from tests.integration.controller import Controller

    ctl = Controller(mosquitto, signer=signer)
    agents = []

    def make_agent(device="dev1", extra_config="", start=True):
        agent = agent_factory(device, extra_config=extra_config, security=keys["security"])
        agents.append(agent)
        if start:
            started(agent)
        return agent

    try:
        yield ctl, make_agent
    finally:
        for agent in agents:
            finish(agent)
        ctl.close()
