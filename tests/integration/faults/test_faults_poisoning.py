"""The fault suite (``suite.py``): issue 33's block poisoning on an OPEN broker (anyone may
publish on a device's block topics), with a real daemon and the test controller.

An attacker subscribed to the device's block requests answers every one with right-sized junk.
For a while it is the only one answering (the controller holds its answers): the per-block hash
lists then fail their sha256 far more often than the 5 tries that once ended the transfer with
``hash_mismatch``; junk from the broker no longer counts towards that. Once the controller
answers again the job succeeds, every junk block of the artifacts dropped by its per-block
hash. Without per-block hashes, a device whose HTTP source was down and whose MQTT blocks
were junk fetches the artifact again from that source, only from it, once it is up."""

import os
import queue
import threading
import time
import uuid

from agent.wire import protocol
from agent.wire.device.transfer import MAX_LIST_TRIES, block_digests
from agent.wire.mqtt import MESSAGE, MqttClient
from tests.integration.faults.suite import SMALL_BLOCKS, audit, calib_file, deploy_doc, fault


class Poisoner(object):
    """Answers each of ``device``'s block requests with right-sized junk, on its block topic."""

    def __init__(self, broker, topics, device):
        self.topics, self.device = topics, device
        self.client = MqttClient("poisoner-" + uuid.uuid4().hex[:6], broker.host, broker.port,
                                 clean_start=True, session_expiry=0, events=queue.Queue())
        self.client.subscribe(topics.artifact_request(device, "0" * 64).replace("0" * 64, "+"),
                              0)
        self.client.start()
        self.client.wait_connected(10)
        self.sent = {}  # sha256 -> junk blocks sent
        self.spare = set()  # sha256s no longer answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                ev = self.client.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if ev.kind != MESSAGE:
                continue
            try:
                msg = protocol.decode("artifact_request", ev.payload)
            except Exception:  # noqa: BLE001 - not a request: nothing to poison
                continue
            if msg["sha256"] in self.spare:
                continue
            want = protocol.bitmap_decode(msg["want"], msg["blocks"])
            for i in protocol.bitmap_indices(want, msg["blocks"]):
                junk = b"\x5a" * protocol.block_length(msg["size"], msg["block_size"], i)
                self.client.publish(self.topics.block(self.device, msg["sha256"], i), junk, qos=0)
                self.sent[msg["sha256"]] = self.sent.get(msg["sha256"], 0) + 1

    def stop(self):
        self._stop.set()
        self._thread.join(10)
        self.client.stop()


def test_junk_blocks_on_an_open_broker_do_not_fail_a_job(fleet, mosquitto, digits_files,
                                                          tmp_path):
    controller, make_agent = fleet
    agent = make_agent(extra_config=SMALL_BLOCKS)  # 1 KiB blocks, a 2 s re-request timeout
    calib = calib_file(tmp_path, 2000)
    doc = deploy_doc(controller, digits_files, "poisoned", calib=calib)
    paths = dict(digits_files, calibration=calib)
    for role, ref in doc["artifacts"].items():  # every artifact with its per-block hashes
        lst = tmp_path / (role + ".blocks")
        lst.write_bytes(block_digests(paths[role], 1024))
        ref["blocks"] = {"block_size": 1024, "sha256": controller.add_artifact(lst)["sha256"]}
    art = doc["artifacts"]["calibration"]
    digests = block_digests(calib, 1024)
    poisoner = Poisoner(mosquitto, controller.topics, "dev1")
    try:
        controller.serve = False  # only the attacker answers for now
        controller.send_job(doc)
        list_blocks = -(-len(digests) // 1024)
        deadline = time.monotonic() + 120
        while poisoner.sent.get(art["blocks"]["sha256"], 0) < 2 * MAX_LIST_TRIES * list_blocks:
            assert time.monotonic() < deadline, (poisoner.sent, agent.log_tail())
            time.sleep(0.2)
        status = controller.last_status("poisoned")
        assert not status or status["state"] not in protocol.TERMINAL_STATES, status
        # The lists are answered by the controller alone from now on (a list cannot be checked
        # block by block: an attacker answering every request first would stall it, as
        # docs/security.md says; with --http it comes from there); the artifacts' blocks are
        # still junked first, each dropped by its per-block hash.
        poisoner.spare.update(ref["blocks"]["sha256"] for ref in doc["artifacts"].values())
        controller.serve = True
        msg = controller.wait_state("poisoned", protocol.TERMINAL_STATES, 180)
        assert msg["state"] == "SUCCEEDED", (msg, agent.log_tail())
        fault("junk_block", sum(poisoner.sent.values()))
    finally:
        poisoner.stop()
    sha = art["sha256"]
    with open(os.path.join(agent.state_dir, "artifacts", sha[:2], sha), "rb") as f:
        assert f.read() == open(calib, "rb").read()
    print("\n{} junk blocks answered first ({} for the hash list); the job succeeded".format(
        sum(poisoner.sent.values()), poisoner.sent.get(art["blocks"]["sha256"], 0)))
    result = audit(agent, controller, ["poisoned"])
    assert not result["lost"] and not result["corrupt"], result


def test_junk_blocks_after_the_http_source_failed_are_fetched_again_from_it(
        fleet, mosquitto, digits_files, tmp_path):
    """No per-block hashes (as a fleet service's rollout sends its artifacts), a URL the device
    cannot reach at first: it falls back to MQTT blocks, where only the attacker answers; the
    assembled file fails its sha256, and the device fetches it once more from the trusted HTTP
    source (up by then) instead of failing the job with hash_mismatch."""
    import socket

    from agent.fleet.transfer.http_source import HttpSource

    controller, make_agent = fleet
    agent = make_agent(extra_config=SMALL_BLOCKS)
    calib = calib_file(tmp_path, 500)
    doc = deploy_doc(controller, digits_files, "refetched", calib=calib)
    art = doc["artifacts"]["calibration"]
    with socket.socket() as s:  # a port nothing listens on, yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for ref in doc["artifacts"].values():  # every artifact at the (not yet listening) URL
        ref["url"] = "http://127.0.0.1:{}/artifacts/{}".format(port, ref["sha256"])
    poisoner = Poisoner(mosquitto, controller.topics, "dev1")
    http = None
    try:
        controller.serve = False  # only the attacker answers over MQTT
        controller.send_job(doc)
        deadline = time.monotonic() + 120
        while poisoner.sent.get(art["sha256"], 0) < 8:
            assert time.monotonic() < deadline, (poisoner.sent, agent.log_tail())
            time.sleep(0.2)
        http = HttpSource("127.0.0.1", port, controller.server.files).start()
        msg = controller.wait_state("refetched", protocol.TERMINAL_STATES, 180)
        assert msg["state"] == "SUCCEEDED", (msg, agent.log_tail())
        fault("junk_block", sum(poisoner.sent.values()))
    finally:
        poisoner.stop()
        controller.serve = True
        if http is not None:
            http.stop()
    sha = art["sha256"]
    with open(os.path.join(agent.state_dir, "artifacts", sha[:2], sha), "rb") as f:
        assert f.read() == open(calib, "rb").read()
    result = audit(agent, controller, ["refetched"])
    assert not result["lost"] and not result["corrupt"], result
