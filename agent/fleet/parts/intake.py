"""``Intake``: the controller's subscriptions, and each MQTT event (drained from the
connection's byte-bounded queue on the service's thread; paho's thread only enqueues) routed to
the part it is for, by the kind of its topic (``agent.wire.topics.TopicInfo.kind``). A kind no
part takes is dropped.
"""

from typing import Any, Callable, Dict, Optional, Sequence

from agent.wire.topics import TopicInfo

Handler = Callable[[TopicInfo, Any], None]


class Intake(object):
    def __init__(self, conn: Any, share_group: Optional[str],
                 routes: Dict[str, Sequence[Handler]]) -> None:
        self.conn = conn
        self.topics = conn.topics
        self.share_group = share_group
        # topic kind -> the parts' handlers, called in this order
        self.routes = {kind: tuple(handlers) for kind, handlers in routes.items()}

    def subscribe(self) -> None:
        self.conn.subscribe([f for f, q in self.topics.controller_subscriptions(
            self.share_group) if q == 1])
        self.conn.subscribe([self.topics.prefix + "/devices/+/telemetry"], 0)

    def on_message(self, info: TopicInfo, msg: Any) -> None:
        for handle in self.routes.get(info.kind, ()):
            handle(info, msg)
