"""A small stand-in for devices in the controller's named-models tests, speaking the real
protocol over a real broker: a retained status (with ``platform.features: ["named_models"]``
or, for an older daemon, without it and with ``active_engines``), the retained ``models``
message for named devices, job documents answered QUEUED -> IN_PROGRESS -> SUCCEEDED (with
``result.model``), and ``rollback`` commands answered as the device's journal would (to the
previous version, or refused with the device's reason). Nothing is built: the daemon's side of
named models is tested with the daemon; this only lets the controller be exercised."""

import threading
import time

import paho.mqtt.client as paho

from agent.wire import model_names, protocol, status_messages
from agent.wire.topics import DEFAULT_PREFIX, Topics, reply_topic


class Device:
    def __init__(self, device, named, models=None, refuse=None):
        self.device = device
        self.named = named
        # name -> {"version", "previous", "state", "health", "job_id", "model"}
        self.models = dict(models or {})
        self.refuse = refuse  # (code, message): every rollback is refused with it
        self.docs = []  # job documents received, decoded
        self.commands = []  # commands received, decoded
        self.boot = 1

    def status(self):
        plat = {"board": "Test Jetson", "backend": "onnxruntime", "precisions": ["fp32", "fp16"]}
        if self.named:
            plat["features"] = [model_names.FEATURE]
        engines = [{"model": m["model"], "engine_key": "k-" + name, "precision": "fp16",
                    "job_id": m.get("job_id") or "j", "activated": 1.0}
                   for name, m in sorted(self.models.items()) if m.get("model")]
        return status_messages.status_message(self.device, True, self.boot, "0.test", plat,
                                              engines, ts=time.time())

    def models_message(self):
        return {"protocol": 1, "device": self.device, "boot": self.boot, "ts": time.time(),
                "models": [dict({"name": name, "state": m.get("state", "committed"),
                                 "previous": m.get("previous"), "precision": "fp16",
                                 "engine_key": "k-" + name, "job_id": m.get("job_id"),
                                 "activated": 1.0, "health": m.get("health", "ok"),
                                 "rejected": []}, version=m["version"])
                           for name, m in sorted(self.models.items())]}


class Responder:
    def __init__(self, broker, devices, prefix=DEFAULT_PREFIX):
        self.topics = Topics(prefix)
        self.devices = {d.device: d for d in devices}
        self.lock = threading.Lock()
        self.versions = {}
        kwargs = {"client_id": "responder-" + str(id(self)), "protocol": paho.MQTTv5}
        if hasattr(paho, "CallbackAPIVersion"):
            kwargs["callback_api_version"] = paho.CallbackAPIVersion.VERSION2
        self.client = paho.Client(**kwargs)
        self.client.on_message = self._on_message
        self.broker = broker

    def start(self):
        self.client.connect(self.broker.host, self.broker.port, 60)
        self.client.loop_start()
        for dev in self.devices.values():
            base = self.topics.prefix + "/devices/" + dev.device
            self.client.subscribe([(base + "/jobs/+", 1), (base + "/commands", 1)])
            self.publish_state(dev, wait=True)
        return self

    def stop(self):
        self.client.loop_stop()
        self.client.disconnect()

    def publish_state(self, dev, wait=False):
        """The retained status (and models message): ``wait`` only outside paho's thread."""
        handles = [self.client.publish(self.topics.status(dev.device),
                                       protocol.encode(dev.status()), 1, True)]
        if dev.named:
            handles.append(self.client.publish(self.topics.models(dev.device),
                                               protocol.encode(dev.models_message()), 1, True))
        for h in handles if wait else ():
            h.wait_for_publish(10)

    def _job_status(self, dev, job_id, kind, state, result=None):
        with self.lock:
            v = self.versions[(dev, job_id)] = self.versions.get((dev, job_id), 0) + 1
        pub = status_messages.job_status_publication(self.topics, dev, {
            "job_id": job_id, "kind": kind, "state": state, "version": v,
            "updated": time.time(), "stage": None, "result": result})
        self.client.publish(pub.topic, pub.payload, 1, True)

    def _on_message(self, client, userdata, message):
        info = self.topics.parse(message.topic)
        dev = self.devices[info.device]
        if info.kind == "job" and message.payload:
            doc = protocol.decode("job", message.payload)
            with self.lock:
                dev.docs.append(doc)
            self._run(dev, doc)
        elif info.kind == "command":
            cmd = protocol.decode("command", message.payload)
            with self.lock:
                dev.commands.append(cmd)
            self._command(dev, cmd)

    def _run(self, dev, doc):
        sha = doc["artifacts"]["model"]["sha256"]
        name = doc.get("model_name") or model_names.derived_name(sha)
        version = doc.get("model_version") or model_names.default_version(sha)
        old = dev.models.get(name)
        dev.models[name] = {"version": version, "previous": old["version"] if old else None,
                            "state": "committed", "job_id": doc["job_id"], "model": sha,
                            "old": old}
        for state in ("QUEUED", "IN_PROGRESS"):
            self._job_status(dev.device, doc["job_id"], doc["kind"], state)
        result = {"precision": "fp16", "throughput_qps": 100.0, "engine_key": "k-" + name}
        if dev.named:
            result["model"] = {"name": name, "version": version,
                               "previous": dev.models[name]["previous"], "state": "committed"}
        self._job_status(dev.device, doc["job_id"], doc["kind"], "SUCCEEDED", result)
        self.publish_state(dev)

    def _command(self, dev, cmd):
        reply = {"protocol": 1, "device": dev.device, "command": cmd["command"],
                 "request_id": cmd.get("request_id")}
        name = cmd.get("name")
        if name is None and cmd.get("model"):
            name = next((n for n, m in dev.models.items() if m.get("model") == cmd["model"]),
                        None)
        held = dev.models.get(name) if name else None
        if dev.refuse is not None or held is None or not held.get("previous"):
            code, text = dev.refuse or ("no_previous_version", "expected a kept previous "
                                        "version of {}, found none".format(name))
            reply.update(ok=False, error={"code": code, "message": text})
        else:
            old = held.get("old") or {}
            dev.models[name] = dict(old, version=held["previous"], previous=None,
                                    state="committed")
            reply.update(ok=True, result={"name": name, "version": held["previous"],
                                          "replaced": held["version"]})
            self.publish_state(dev)
        self.client.publish(reply_topic(self.topics, dev.device, cmd),
                            protocol.encode(reply), 1)
