"""``fleet telemetry DEVICE [--follow]``: a device's health samples, from its telemetry topic
or, sooner, the last sample its ``diag`` reply carries."""

import time
import uuid
from typing import Any, Callable, Dict, List, Tuple

from agent import fleet
from agent.wire import protocol
from agent.wire.topics import TopicInfo


def watch(connect: Callable[[], Any], device: str, timeout: float, follow: bool,
          on_sample: Callable[[Dict[str, Any]], None]) -> Tuple[Dict[str, Any], bool]:
    """Hand each sample to ``on_sample``: with ``follow`` every one until Ctrl-C, else the
    first within ``timeout`` s (none: never called). (the device's retained status, whether
    Ctrl-C ended it)."""
    conn = connect()
    samples: List[Dict[str, Any]] = []
    try:
        fleet.discover(conn)
        fleet.select_devices(conn.directory.known(), [device])
        status = conn.directory.status[device]
        rid = "d" + uuid.uuid4().hex[:10]

        def on_message(info: TopicInfo, msg: Any) -> None:
            if info.device != device:
                return
            if info.kind == "telemetry":
                samples.append(msg)
            elif info.kind == "command_reply" and msg.get("request_id") == rid and msg.get("ok"):
                tele = (msg.get("result") or {}).get("telemetry")
                if tele and not samples:
                    samples.append({"protocol": 1, "device": device, "ts": time.time(),
                                    "source": "diag", "metrics": tele})

        conn.subscribe([conn.topics.telemetry(device)], 0)
        conn.subscribe([conn.topics.command_reply(device)])
        conn.settle(on_message)
        if status.get("online") is not False:
            # The diag reply carries the last sample: no wait for the next telemetry tick.
            conn.publish(conn.topics.commands(device), protocol.encode({
                "protocol": protocol.PROTOCOL_VERSION, "command": "diag", "request_id": rid}),
                qos=1)
        if follow:
            try:
                while True:
                    conn.pump(on_message, 0.5)
                    while samples:
                        on_sample(samples.pop(0))
            except KeyboardInterrupt:
                return status, True
        deadline = time.monotonic() + timeout
        while not samples and time.monotonic() < deadline:
            conn.pump(on_message, 0.2)
    finally:
        conn.close()
    if samples:
        on_sample(samples[0])
    return status, False
