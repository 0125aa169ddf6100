"""A minimal fleet controller for the integration tests (the ``controller`` fixture in
conftest.py): serves artifact blocks, sends jobs and commands, records what devices say."""

import os
import time


class Controller:
    """What a fleet controller does, minimally: serve artifact blocks, send jobs and commands,
    record device, job and telemetry messages. Uses agent.wire.mqtt and
    agent.wire.device.transfer."""

    def __init__(self, broker, device="dev1", signer=None, **client_kwargs):
        import queue
        import threading
        import uuid

        from agent.wire.device.transfer import BlockServer
        from agent.wire.mqtt import MqttClient
        from agent.wire.topics import Topics

        self.device = device
        self.signer = signer  # agent.wire.job_signer.Signer: send_job signs the documents
        self.topics = Topics()
        self.client = MqttClient("ctl-" + uuid.uuid4().hex[:8], broker.host, broker.port,
                                 reconnect_min=0.2, reconnect_max=1.0, events=queue.Queue(),
                                 **client_kwargs)
        self.server = BlockServer(self._publish_block, self.topics)
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.job_status = {}  # job_id -> list of status messages, arrival order
        self.device_status = []
        self.telemetry = []
        self.models = []
        self.replies = []
        self.models = []  # retained per-name models messages (named models), arrival order
        self.requests = []  # decoded artifact requests
        self.blocks_sent = {}  # (sha, index) -> times sent
        self.serve = True  # False: requests are recorded but not answered
        self.served_limit = None  # stop answering after this many blocks (then serve=False)
        self.errors = []
        for topic, qos in self.topics.controller_subscriptions():
            self.client.subscribe(topic, qos)
        self._stop = False
        self.client.start()
        self.client.wait_connected(10)
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _publish_block(self, topic, payload, qos=1, retain=False):
        info = self.topics.parse(topic)
        key = (info.sha256, info.index)
        self.blocks_sent[key] = self.blocks_sent.get(key, 0) + 1
        self.client.publish(topic, payload, qos=qos, retain=retain)

    def _pump(self):
        import queue

        from agent.wire import mqtt, protocol

        while not self._stop:
            try:
                ev = self.client.events.get(timeout=0.2)
            except queue.Empty:
                continue
            if ev.kind != mqtt.MESSAGE:
                continue
            try:
                info = self.topics.parse(ev.topic)
                if info.kind == "artifact_request":
                    msg = protocol.decode("artifact_request", ev.payload)
                    with self.lock:
                        self.requests.append(msg)
                        serve = self.serve
                        if self.served_limit is not None:
                            if sum(self.blocks_sent.values()) >= self.served_limit:
                                self.serve = serve = False
                    if serve:
                        self.server.handle_request(ev.topic, ev.payload)
                    continue
                if not ev.payload:
                    continue
                if info.kind == "models":
                    import json

                    with self.cond:
                        self.models.append(json.loads(ev.payload.decode("utf-8")))
                        self.cond.notify_all()
                    continue
                msg = protocol.decode(info.kind, ev.payload)
                with self.cond:
                    if info.kind == "job_status":
                        self.job_status.setdefault(info.job_id, []).append(msg)
                    elif info.kind == "status":
                        self.device_status.append(msg)
                    elif info.kind == "telemetry":
                        self.telemetry.append(msg)
                    elif info.kind == "models":  # named models: the retained per-name state
                        self.models.append(msg)
                    elif info.kind == "command_reply":
                        self.replies.append(msg)
                    self.cond.notify_all()
            except Exception as exc:  # noqa: BLE001 - recorded; the test asserts on it
                self.errors.append("{}: {!r}".format(ev.topic, exc))

    def add_artifact(self, path, name=None):
        sha = self.server.add_file(str(path))
        return {"sha256": sha, "size": os.path.getsize(str(path)),
                "name": name or os.path.basename(str(path))}

    def send_job(self, doc, retain=True):
        from agent.wire import protocol

        doc = dict(doc)
        doc.setdefault("protocol", 1)
        doc.setdefault("device", self.device)
        if self.signer is not None:
            doc = self.signer.sign(doc)
        h = self.client.publish(self.topics.job(self.device, doc["job_id"]),
                                protocol.encode(doc), qos=1, retain=retain)
        assert h.wait(10), "job document not acknowledged by the broker"
        return doc

    def send_raw(self, topic, payload, qos=1, retain=False):
        return self.client.publish(topic, payload, qos=qos, retain=retain)

    def command(self, cmd):
        from agent.wire import protocol

        cmd = dict(cmd)
        cmd.setdefault("protocol", 1)
        h = self.client.publish(self.topics.commands(self.device), protocol.encode(cmd), qos=1)
        assert h.wait(10)

    def wait_for(self, predicate, timeout, what="condition"):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("timed out after {} s waiting for {}".format(
                        timeout, what))
                self.cond.wait(min(left, 0.5))

    def wait_online(self, device=None, timeout=30):
        """Until the device's birth message (online) has arrived: it is subscribed by then."""
        device = device or self.device
        return self.wait_for(
            lambda: next((s for s in reversed(self.device_status)
                          if s["device"] == device and s["online"]), None),
            timeout, "device {} online".format(device))

    def last_status(self, job_id):
        with self.lock:
            msgs = self.job_status.get(job_id) or []
            return msgs[-1] if msgs else None

    def wait_state(self, job_id, states, timeout=60):
        states = (states,) if isinstance(states, str) else tuple(states)

        def done():
            last = self.last_status(job_id)
            return last if last is not None and last["state"] in states else None

        return self.wait_for(done, timeout, "job {} to reach {} (last: {})".format(
            job_id, states, self.last_status(job_id)))

    def wait_stage(self, job_id, stages, timeout=60):
        stages = (stages,) if isinstance(stages, str) else tuple(stages)

        def seen():
            with self.lock:
                return any(m.get("stage") in stages for m in self.job_status.get(job_id, []))

        return self.wait_for(seen, timeout, "job {} stage {}".format(job_id, stages))

    def diag(self, timeout=20):
        import uuid

        rid = "r" + uuid.uuid4().hex[:8]
        self.command({"command": "diag", "request_id": rid})
        return self.wait_for(
            lambda: next((r for r in self.replies if r.get("request_id") == rid), None),
            timeout, "diag reply")

    def close(self):
        self._stop = True
        self.client.stop()
        self.thread.join(5)
