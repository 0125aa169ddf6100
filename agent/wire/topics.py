"""MQTT topic names of the protocol: building them, parsing them, and where replies may go.

Pure. Every topic lives under one prefix, ``{prefix}/devices/{device}/...``, plus the shared
fan-out block topics ``{prefix}/artifacts/{sha256}/block/N``; ``Topics.parse`` validates every
id it reads, so a topic that arrives from the broker is as checked as a payload.
"""

import re
from typing import Any, List, Mapping, NamedTuple, Optional, Tuple

from agent.errors import AgentError
from agent.wire.json_schema import short
from agent.wire.protocol import MAX_BLOCKS, check_id, check_sha256, valid_id

DEFAULT_PREFIX = "jetson-agent"
MAX_REPLY_TOPIC = 256

_INDEX_RE = re.compile(r"0|[1-9][0-9]{0,6}")


class TopicInfo(NamedTuple):
    """What a topic names. ``kind`` is one of MESSAGE_KINDS or "block"."""

    kind: str
    device: str
    job_id: Optional[str] = None
    sha256: Optional[str] = None
    block: Optional[int] = None  # block index


def _check_publish_topic(what: str, topic: Any, max_len: int = MAX_REPLY_TOPIC) -> str:
    if (
        not isinstance(topic, str)
        or not topic
        or len(topic.encode("utf-8")) > max_len
        or topic.startswith("$")
        or any(c in topic for c in "+#\x00")
    ):
        raise AgentError(
            "bad_message",
            "{} must be an MQTT topic without wildcards, not starting with '$', at most {} "
            "bytes, found {}".format(what, max_len, short(topic)),
        )
    return topic


class Topics(object):
    """Topic names under one prefix: ``{prefix}/devices/{device}/...``."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        levels = prefix.split("/") if isinstance(prefix, str) else []
        if not levels or any(not lv or set(lv) & set("+#\x00") for lv in levels) or (
                prefix.startswith("$")):
            raise AgentError(
                "bad_config",
                "topic prefix must be one or more non-empty levels without wildcards, not "
                "starting with '$', found {}".format(short(prefix)),
            )
        self.prefix = prefix
        self._levels = levels

    def _dev(self, device: str) -> str:
        return "{}/devices/{}".format(self.prefix, check_id("device id", device))

    def status(self, device: str) -> str:
        return self._dev(device) + "/status"

    def job(self, device: str, job_id: str) -> str:
        return "{}/jobs/{}".format(self._dev(device), check_id("job id", job_id))

    def job_status(self, device: str, job_id: str) -> str:
        return self.job(device, job_id) + "/status"

    def artifact_request(self, device: str, sha256: str) -> str:
        return "{}/artifacts/{}/request".format(self._dev(device), check_sha256(sha256))

    def block(self, device: str, sha256: str, index: int) -> str:
        if not isinstance(index, int) or not 0 <= index < MAX_BLOCKS:
            raise AgentError("bad_message", "block index must be 0..{}, found {}".format(
                MAX_BLOCKS - 1, short(index)))
        return "{}/artifacts/{}/block/{}".format(self._dev(device), check_sha256(sha256), index)

    def fanout_block(self, sha256: str, index: int) -> str:
        """Block ``index`` on the artifact's shared topic: published once, the broker hands
        it to every device fetching the artifact (they subscribe while they fetch)."""
        if not isinstance(index, int) or not 0 <= index < MAX_BLOCKS:
            raise AgentError("bad_message", "block index must be 0..{}, found {}".format(
                MAX_BLOCKS - 1, short(index)))
        return "{}/artifacts/{}/block/{}".format(self.prefix, check_sha256(sha256), index)

    def fanout_blocks(self, sha256: str) -> str:
        return "{}/artifacts/{}/block/+".format(self.prefix, check_sha256(sha256))

    def telemetry(self, device: str) -> str:
        return self._dev(device) + "/telemetry"

    def models(self, device: str) -> str:
        """The retained per-name models state (named models: its schema is ``models.json``)."""
        return self._dev(device) + "/models"

    def commands(self, device: str) -> str:
        return self._dev(device) + "/commands"

    def command_reply(self, device: str) -> str:
        return self._dev(device) + "/commands/reply"

    def device_subscriptions(self, device: str) -> List[Tuple[str, int]]:
        """What a device subscribes to: its job documents, artifact blocks and commands."""
        base = self._dev(device)
        return [(base + "/jobs/+", 1), (base + "/artifacts/+/block/+", 1),
                (base + "/commands", 1)]

    def controller_subscriptions(
        self, share_group: Optional[str] = None, serve_blocks: bool = True
    ) -> List[Tuple[str, int]]:
        """What a controller subscribes to. ``share_group`` puts the block requests on an MQTT v5
        shared subscription so that several controller workers split them; the retained status
        topics are never shared (brokers send no retained messages to shared subscriptions)."""
        base = self.prefix + "/devices/+"
        subs = [(base + "/status", 1), (base + "/jobs/+/status", 1), (base + "/telemetry", 0),
                (base + "/commands/reply", 1), (base + "/commands/reply/+", 1)]
        if serve_blocks:
            requests = base + "/artifacts/+/request"
            if share_group is not None:
                requests = "$share/{}/{}".format(check_id("share group", share_group), requests)
            subs.append((requests, 1))
        return subs

    def parse(self, topic: str) -> TopicInfo:
        """The kind and ids a topic names; ids are validated. AgentError bad_message."""
        parts = topic.split("/") if isinstance(topic, str) else []
        n = len(self._levels)
        if parts[:n] == self._levels and len(parts) == n + 4 and parts[n] == "artifacts" \
                and parts[n + 2] == "block":
            # A shared (fan-out) block: no device level, ``device`` is "".
            sha = check_sha256(parts[n + 1])
            if _INDEX_RE.fullmatch(parts[n + 3]) is None or int(parts[n + 3]) >= MAX_BLOCKS:
                raise AgentError("bad_message", "block index must be a decimal 0..{}, found {}"
                                 .format(MAX_BLOCKS - 1, short(parts[n + 3])))
            return TopicInfo("block", "", sha256=sha, block=int(parts[n + 3]))
        if parts[:n] != self._levels or len(parts) < n + 3 or parts[n] != "devices":
            raise AgentError("bad_message", "expected a topic under {}/devices/, found {}".format(
                self.prefix, short(topic)))
        device = check_id("device id", parts[n + 1])
        rest = parts[n + 2:]
        if rest == ["status"]:
            return TopicInfo("status", device)
        if rest == ["telemetry"]:
            return TopicInfo("telemetry", device)
        if rest == ["models"]:
            return TopicInfo("models", device)
        if rest == ["commands"]:
            return TopicInfo("command", device)
        if rest == ["commands", "reply"] or (rest[:2] == ["commands", "reply"] and len(rest) == 3
                                            and valid_id(rest[2])):
            return TopicInfo("command_reply", device)
        if len(rest) == 2 and rest[0] == "jobs":
            return TopicInfo("job", device, job_id=check_id("job id", rest[1]))
        if len(rest) == 3 and rest[0] == "jobs" and rest[2] == "status":
            return TopicInfo("job_status", device, job_id=check_id("job id", rest[1]))
        if len(rest) == 3 and rest[0] == "artifacts" and rest[2] == "request":
            return TopicInfo("artifact_request", device, sha256=check_sha256(rest[1]))
        if len(rest) == 4 and rest[0] == "artifacts" and rest[2] == "block":
            sha = check_sha256(rest[1])
            if _INDEX_RE.fullmatch(rest[3]) is None or int(rest[3]) >= MAX_BLOCKS:
                raise AgentError("bad_message", "block index must be a decimal 0..{}, found {}"
                                 .format(MAX_BLOCKS - 1, short(rest[3])))
            return TopicInfo("block", device, sha256=sha, block=int(rest[3]))
        raise AgentError(
            "bad_message",
            "expected status, telemetry, models, commands[/reply], jobs/ID[/status], "
            "artifacts/SHA/request or artifacts/SHA/block/N after the device id, found {}".format(
                short("/".join(rest))),
        )


def reply_topic(topics: Topics, device: str, command: Mapping[str, Any],
                response_topic: Optional[str] = None) -> str:
    """Where a command reply goes: the MQTT v5 response topic, else the command's ``reply_to``
    (MQTT 3.1.1), else ``{prefix}/devices/{id}/commands/reply``. Only the controller's reply
    topics are allowed: that topic or one level below it (``.../commands/reply/REQUEST``), so a
    command cannot make the device publish on another device's topics or a job's status.
    AgentError bad_message."""
    default = topics.command_reply(device)
    for what, topic in (("response topic", response_topic), ("reply_to",
                                                             command.get("reply_to"))):
        if topic is None:
            continue
        _check_publish_topic(what, topic)
        rest = topic[len(default) + 1:] if topic.startswith(default + "/") else None
        if topic != default and not valid_id(rest):
            raise AgentError("bad_message", "{} must be {} or {}/ID (the controller's reply "
                             "topics), found {}".format(what, default, default, short(topic)))
        return topic
    return default

