"""``DeploymentsHook``: the deployments' part of ``fleet serve``
(``agent.fleet.deployments.deployment_runner.DeploymentRunner``, the ``runner``; none for an
embedded ``fleet rollout``), told of births, Wills, models messages and its rollouts' job ends,
ticked before leases are taken; and the devices' answers to rollback commands recorded.
"""

import logging
from typing import Any, Dict, Iterable

from agent.errors import AgentError
from agent.fleet.deployments import deployment_runner, pins
from agent.fleet.rollouts import rollback_log
from agent.wire.topics import TopicInfo

log = logging.getLogger("agent.fleet")


class DeploymentsHook(object):
    def __init__(self, store: Any) -> None:
        self.store = store
        self.runner: Any = None  # a DeploymentRunner (fleet serve sets it)

    def touch(self, devices: Iterable[str]) -> None:
        if self.runner is not None:
            self.runner.touch(devices)

    def job_ended(self, rollout_id: str, device: str, msg: Dict[str, Any]) -> None:
        deployment_runner.job_ended(self.runner, rollout_id, device, msg)

    def tick(self) -> None:
        if self.runner is not None:
            try:
                self.runner.tick()
            except AgentError as exc:
                log.error("deployments: %s", exc)

    def on_command_reply(self, info: TopicInfo, msg: Dict[str, Any]) -> None:
        if msg.get("command") in (None, "rollback"):  # recorded by rollback_log, if ours
            if rollback_log.on_reply(self.store, info.device, msg):  # its first reply
                pins.on_rollback_reply(self.store, info.device, msg)  # its pin's version
