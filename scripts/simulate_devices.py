#!/usr/bin/env python3
"""Many simulated devices in one process, speaking the real protocol (docs/protocol.md) over
``--connections`` MQTT connections (by default one per 10 devices, at most 100; device ``i``
on connection ``i % N``, each connection subscribed to its own devices' topics only, so the
broker pays its per-client costs as with real devices): a retained birth status per device,
job documents received on ``{p}/devices/{id}/jobs/{job}``, job statuses QUEUED ->
IN_PROGRESS -> SUCCEEDED (retained, QoS 1, increasing versions), and with ``--fetch`` every
artifact requested block by block (want bitmaps, a window of blocks at a time) before the job
succeeds. For scale tests of the
controller (scripts/benchmarks/fleet_scale.py), not a device emulator: nothing is built.
All connections are served by one network thread (``select`` over their sockets): a paho loop
thread per connection spent the simulator's time switching threads, not handling messages.
A connection lost on a busy host reconnects and subscribes again.
With ``--identity`` (``SimulatedFleet(identity=True)``) each device has its own Ed25519 key
(in memory), announces it in its birth and signs everything it publishes as a daemon does
(``agent.wire.device_identity``); ``write_keys(path)`` writes the public keys for the
controller's ``--admission keys --admission-keys FILE``, as manufacturing would.
With ``acks`` on (the default; ``--no-acks``: devices of the release before) each device waits
for the controller's acknowledgement of its birth and publishes it again until it comes, and
answers the controller's call at its slot of the call's window, as a daemon does
(agent.device.birth_pacing); ``acked`` holds the devices acknowledged.

    python scripts/simulate_devices.py --broker mqtt://127.0.0.1:1883 --count 10000 \
        --connections 100
"""

import argparse
import copy
import heapq
import json
import os
import select
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import paho.mqtt.client as paho  # noqa: E402

from agent.wire import protocol, rollcall, status_messages  # noqa: E402
from agent.wire.topics import DEFAULT_PREFIX, Topics  # noqa: E402

PLATFORM = {"board": "Simulated Jetson", "backend": "simulated", "precisions": ["fp32", "fp16"]}
WINDOW = 64
RETRY_S = 5.0  # blocks still missing this long after their request are asked for again
MAX_DEFAULT_CONNECTIONS = 100
DEVICES_PER_CONNECTION = 10  # the default: one connection per 10 devices, at most 100
SUBSCRIBE_BATCH = 100  # topic filters per SUBSCRIBE packet


def default_connections(count: int) -> int:
    """One connection per DEVICES_PER_CONNECTION devices, at least 1, at most 100."""
    return max(1, min(MAX_DEFAULT_CONNECTIONS, count // DEVICES_PER_CONNECTION))


def _no_op(*args: Any) -> None:
    pass


_TEMPLATE: List[Any] = []


def _publish_properties(users: List[Tuple[str, str]]) -> Any:
    """PUBLISH properties carrying ``users``: a copy of one empty set (paho's constructor and
    checked assignment were a fifth of a busy simulator's time; the result packs the same)."""
    if not _TEMPLATE:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        _TEMPLATE.append(Properties(PacketTypes.PUBLISH))
    props = copy.copy(_TEMPLATE[0])
    props.__dict__["UserProperty"] = list(users)
    return props


class _Fetch(object):
    def __init__(self, sha: str, size: int, block_size: int) -> None:
        self.sha, self.size, self.block_size = sha, size, block_size
        self.blocks = protocol.block_count(size, block_size)
        self.next = 0  # first block not yet requested
        self.pending: set = set()  # requested, not yet received
        self.asked = 0.0  # when they were (monotonic)


class SimulatedFleet(object):
    """``count`` devices named ``{name}-{i:05d}`` over ``connections`` MQTT connections
    (``default_connections(count)`` when None). ``start()`` connects and publishes their
    births; ``jobs`` (device -> [job ids]) and ``succeeded`` fill as jobs arrive and end.
    ``client`` is the first connection; ``flush()`` waits until the broker acknowledged
    everything published so far on every connection."""

    def __init__(self, host: str, port: int, count: int, name: str = "sim",
                 prefix: str = DEFAULT_PREFIX, fetch: bool = False,
                 fanout: bool = False, roll_call: bool = True,
                 labels: Optional[Dict[str, str]] = None, identity: bool = False,
                 connections: Optional[int] = None, acks: bool = True,
                 ack_wait_s: float = rollcall.ACK_WAIT_S) -> None:
        self.topics = Topics(prefix)
        self.roll_call = roll_call  # False: devices of the release before the roll call
        self.platform = dict(PLATFORM, labels=dict(labels)) if labels else dict(PLATFORM)
        self.acks, self.ack_wait_s = acks, ack_wait_s
        if acks:
            self.platform["features"] = [rollcall.ACK_FEATURE]
        self.acked: Dict[str, Optional[str]] = {}  # device -> the call its ack named
        self.answered: Dict[str, str] = {}  # device -> the last call it answered
        self.call: Optional[str] = None  # the last call heard
        self.births = 0  # births published, retries and answers included
        self.last_ack: Optional[float] = None  # when the last device was first acknowledged
        self.window_s: Optional[float] = None  # the last call's (None: no call heard)
        self._due: List[Tuple[float, int, str]] = []  # (when, generation, device): heap
        self._gen: Dict[str, int] = {}  # device -> its pending birth's generation
        self._attempt: Dict[str, int] = {}
        self._sent: Dict[str, float] = {}  # device -> when its last birth went out
        self.devices = ["{}-{:05d}".format(name, i) for i in range(count)]
        self.known = set(self.devices)
        self.fetch = fetch
        self.fanout = fanout  # listen on the shared block topics, say so in requests
        self.lock = threading.Lock()
        self.jobs: Dict[str, List[str]] = {}
        self.succeeded = 0
        self.first_doc: Optional[float] = None
        self.last_doc: Optional[float] = None
        self.last_final: Optional[float] = None  # when the last SUCCEEDED was handed to paho
        self.connects = 0  # CONNACKs, all connections (more than one each: reconnections)
        self.block_bytes = 0
        self.block_messages = 0
        self._net: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._up = threading.Condition()
        self._acked: set = set()  # connections the broker accepted (CONNACK)
        self._versions: Dict[Any, int] = {}
        n = default_connections(count) if connections is None else int(connections)
        if not 1 <= n <= max(1, count):
            raise ValueError("expected 1..{} connections (one device at least on each), found "
                             "{}".format(max(1, count), n))
        self.clients: List[Any] = []
        for k in range(n):
            kwargs: Dict[str, Any] = {
                "client_id": "simfleet-" + name + ("-{}".format(k) if k else ""),
                "protocol": paho.MQTTv5, "userdata": k}
            if hasattr(paho, "CallbackAPIVersion"):
                kwargs["callback_api_version"] = paho.CallbackAPIVersion.VERSION2
            client = paho.Client(**kwargs)
            # No in-flight window: paho scans every message it holds at each acknowledgement
            # to find the next one to send (most of a busy simulator's time); the broker
            # acknowledges QoS 1 at once.
            client.max_inflight_messages_set(0)
            client.max_queued_messages_set(0)
            client.on_message = self._on_message
            client.on_connect = self._on_connect
            # Writes happen in the network thread only (a publish from another thread would
            # otherwise write to the socket itself, racing it); it looks every 10 ms.
            client.on_socket_register_write = _no_op
            self.clients.append(client)
        self.client = self.clients[0]
        # device -> its connection's index; a connection's devices
        self.conn_of = {dev: i % n for i, dev in enumerate(self.devices)}
        self.conn_devices: List[List[str]] = [self.devices[k::n] for k in range(n)]
        # per connection: (device, job) -> artifacts left
        self._fetches: List[Dict[Any, List[_Fetch]]] = [{} for _ in range(n)]
        self.host, self.port = host, port
        self.signers: Dict[str, Any] = {}
        if identity:
            from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

            from agent.wire.device_identity import DeviceKey, ReportSigner

            for dev in self.devices:
                self.signers[dev] = ReportSigner(DeviceKey(Ed25519PrivateKey.generate()), dev, 1)

    def write_keys(self, path: str) -> str:
        """The devices' public keys, one a line after the id each is bound to
        (``--admission-keys``: ``ID KEY``)."""
        with open(path, "w") as f:
            for dev, signer in self.signers.items():
                f.write(dev + " " + signer.key.public_base64 + "\n")
        return path

    def _publish(self, dev: str, topic: str, payload: bytes, retain: bool = False) -> None:
        """A device's publish, signed with its key when it has one."""
        props = None
        signer = self.signers.get(dev)
        if signer is not None:
            props = _publish_properties(signer.properties(topic, payload))
        self.clients[self.conn_of[dev]].publish(topic, payload, 1, retain, properties=props)

    def start(self) -> None:
        for client in self.clients:
            client.connect(self.host, self.port, 60)
        self._stopping.clear()
        self._net = threading.Thread(target=self._network, name="simfleet-net", daemon=True)
        self._net.start()
        with self._up:  # every CONNACK, then the births
            if not self._up.wait_for(lambda: self._acked == set(range(len(self.clients))), 60):
                raise TimeoutError("the broker did not accept all {} simulator connections "
                                   "within 60 s".format(len(self.clients)))
        for dev in self.devices:
            self._birth(dev)

    def _birth(self, dev: str) -> None:
        """The device's retained birth and roll-call entry; with acks, its retry scheduled."""
        platform = dict(self.platform)
        if dev in self.signers:
            platform["identity"] = self.signers[dev].key.identity()
        msg = status_messages.status_message(dev, True, 1, "sim", platform, [], ts=time.time())
        self._publish(dev, self.topics.status(dev), protocol.encode(msg), True)
        if self.roll_call:
            self.clients[self.conn_of[dev]].publish(
                rollcall.topic(self.topics.prefix, dev), rollcall.encode_marker(dev, 1), 1, True)
        if self.acks:
            with self.lock:
                self.births += 1
                attempt = self._attempt.get(dev, 0)
                self._attempt[dev] = attempt + 1
                self._sent[dev] = time.monotonic()
                self._pace(dev)

    def _pace(self, dev: str) -> None:
        """(Holding the lock.) A birth not acknowledged goes out again after its backoff (or
        now, if that passed before a call came) plus its slot of the window; before any call,
        not at all (agent.device.birth_pacing)."""
        if self.window_s is None:
            return
        backoff = rollcall.retry_delay(dev, self._attempt[dev] - 1, 0.0, self.ack_wait_s)
        at = max(self._sent[dev] + backoff, time.monotonic()) + rollcall.slot(dev) * \
            self.window_s
        self._schedule(dev, at - time.monotonic())

    def _schedule(self, dev: str, delay: float) -> None:
        """(Holding the lock.) The device's birth again in ``delay`` s; earlier plans void."""
        gen = self._gen.get(dev, 0) + 1
        self._gen[dev] = gen
        heapq.heappush(self._due, (time.monotonic() + delay, gen, dev))

    def _births_due(self) -> None:
        """(The network thread.) Births whose acknowledgement is overdue, or whose slot of a
        call's window came, published again."""
        now, due = time.monotonic(), []
        with self.lock:
            while self._due and self._due[0][0] <= now:
                _t, gen, dev = heapq.heappop(self._due)
                if self._gen.get(dev) == gen:
                    due.append(dev)
        for dev in due:
            self._birth(dev)

    def _on_ack(self, dev: str, payload: bytes) -> None:
        ack = rollcall.parse_ack(dev, payload)
        if ack is None or ack[0] != 1:
            return
        with self.lock:
            self._gen[dev] = self._gen.get(dev, 0) + 1  # no retry
            self._attempt[dev] = 0
            if dev not in self.acked:
                self.last_ack = time.time()
            self.acked[dev] = ack[1]

    def _on_call(self, conn: int, payload: bytes) -> None:
        """A call, delivered on every connection: that connection's acknowledged devices
        answer it at their slots."""
        call = rollcall.parse_call(payload)
        if call is None:
            return
        token, window = call
        with self.lock:
            self.window_s, self.call = window, token
            for dev in self.conn_devices[conn]:
                if dev not in self.acked:  # its retry, paced by the call's window
                    if dev in self._sent:
                        self._pace(dev)
                elif token not in (self.acked[dev], self.answered.get(dev)):
                    self.answered[dev] = token
                    self._attempt[dev] = 0
                    self._schedule(dev, rollcall.slot(dev) * window)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until the broker acknowledged what every connection published so far (QoS 1
        is acknowledged in order on a connection: one marker each)."""
        deadline = time.monotonic() + timeout
        marks = [c.publish(self.topics.prefix + "/sim-done", b"", 1) for c in self.clients]
        for info in marks:
            info.wait_for_publish(max(0.1, deadline - time.monotonic()))
            if not info.is_published():
                raise TimeoutError("the broker did not acknowledge the simulated devices' "
                                   "messages within {} s".format(timeout))

    def stop(self) -> None:
        self._stopping.set()
        if self._net is not None:
            self._net.join(10)
        for client in self.clients:
            client.disconnect()

    def _subscribe(self, k: int) -> None:
        """Connection ``k``'s devices' topics (at each connection: a lost session forgets)."""
        filters = []
        for dev in self.conn_devices[k]:
            base = self.topics.prefix + "/devices/" + dev
            filters += [(base + "/jobs/+", 1), (base + "/artifacts/+/block/+", 1)]
        if self.fanout:  # the artifacts' shared block topics, as a fetching device does
            filters.append((self.topics.prefix + "/artifacts/+/block/+", 1))
        if self.acks:
            filters.append((rollcall.call_topic(self.topics.prefix), 1))
            filters += [(rollcall.ack_topic(self.topics.prefix, dev), 1)
                        for dev in self.conn_devices[k]]
        client = self.clients[k]
        for i in range(0, len(filters), SUBSCRIBE_BATCH):
            client.subscribe(filters[i:i + SUBSCRIBE_BATCH])

    def _on_connect(self, client: Any, userdata: Any, *rest: Any) -> None:
        with self._up:
            self.connects += 1
            self._acked.add(userdata)
            self._up.notify_all()
        self._subscribe(userdata)

    def _network(self) -> None:
        """Every connection's reads, writes and keep-alives, in this one thread."""
        misc_at = 0.0
        while not self._stopping.is_set():
            socks: Dict[Any, Any] = {}
            writes = []
            for client in self.clients:
                sock = client.socket()
                if sock is None:
                    continue
                socks[sock] = client
                if client.want_write():
                    writes.append(sock)
            try:
                readable, writable, _ = select.select(list(socks), writes, [], 0.01)
            except (OSError, ValueError):  # a socket closed under us: look again
                readable, writable = [], []
            for sock in readable:
                socks[sock].loop_read()
            for sock in writable:
                if sock in socks:
                    socks[sock].loop_write()
            if self.acks:
                self._births_due()
            now = time.monotonic()
            if now - misc_at >= 1.0:
                misc_at = now
                for client in self.clients:
                    if client.socket() is None:
                        try:
                            client.reconnect()
                        except OSError:
                            pass
                    else:
                        client.loop_misc()
                self._retry(now)

    def _status(self, dev: str, job_id: str, kind: str, state: str, stage: str = "",
                result: Optional[Dict[str, Any]] = None) -> None:
        key = (dev, job_id)
        with self.lock:
            version = self._versions.get(key, 0) + 1
            self._versions[key] = version
        row: Dict[str, Any] = {"job_id": job_id, "kind": kind, "state": state,
                               "version": version, "updated": time.time(),
                               "stage": stage or None, "result": result}
        pub = status_messages.job_status_publication(self.topics, dev, row)
        self._publish(dev, pub.topic, pub.payload, True)

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        roll = self.topics.prefix + "/rollcall/"
        if message.topic.startswith(roll):
            if message.topic == roll + "call":
                self._on_call(userdata, message.payload)
            elif message.topic.startswith(roll + "ack/"):
                dev = message.topic[len(roll) + 4:]
                if dev in self.known:
                    self._on_ack(dev, message.payload)
            return
        try:
            info = self.topics.parse(message.topic)
        except Exception:  # noqa: BLE001 - not ours
            return
        if info.device not in self.known and not (info.kind == "block" and not info.device):
            return
        if info.kind == "block":
            self._on_block(info, message.payload, userdata)
        elif info.kind == "job" and message.payload:
            self._on_job(info, message.payload)

    def _on_job(self, info: Any, payload: bytes) -> None:
        doc = protocol.decode("job", payload)
        dev, job_id = info.device, info.job_id
        now = time.time()
        with self.lock:
            if job_id in self.jobs.setdefault(dev, []):
                return  # a duplicate: a real device answers with its state again
            self.jobs[dev].append(job_id)
            self.first_doc = self.first_doc or now
            self.last_doc = now
        kind = doc["kind"]
        self._status(dev, job_id, kind, "QUEUED")
        self._status(dev, job_id, kind, "IN_PROGRESS", "downloading")
        if self.fetch:
            fetches = []
            for ref in (doc.get("artifacts") or {}).values():
                block_size = protocol.manifest_block_size(ref["size"])
                fetches.append(_Fetch(ref["sha256"], ref["size"], block_size))
            with self.lock:
                self._fetches[self.conn_of[dev]][(dev, job_id)] = fetches
            self._request(dev, job_id)
        else:
            self._finish(dev, job_id, kind)

    def _request(self, dev: str, job_id: str) -> None:
        with self.lock:
            pending = self._fetches[self.conn_of[dev]]
            fetches = pending.get((dev, job_id)) or []
            while fetches and fetches[0].next >= fetches[0].blocks and not fetches[0].pending:
                fetches.pop(0)
            if not fetches:
                pending.pop((dev, job_id), None)
                done = True
            else:
                done = False
                f = fetches[0]
                indices = list(range(f.next, min(f.blocks, f.next + WINDOW)))
                f.next += len(indices)
                f.pending = set(indices)
                f.asked = time.monotonic()
        if done:
            self._finish(dev, job_id, "deploy")
            return
        want = protocol.bitmap_from_indices(indices, f.blocks)
        msg = protocol.request_message(f.sha, f.size, f.block_size, want, job_id, self.fanout)
        self._publish(dev, self.topics.artifact_request(dev, f.sha), protocol.encode(msg))

    def _retry(self, now: float) -> None:
        """Ask again for blocks missing RETRY_S after their request (as a daemon does: the
        answer, or the request, may have been lost with a controller)."""
        again = []
        with self.lock:
            for pending in self._fetches:
                for (dev, job_id), fetches in pending.items():
                    f = fetches[0] if fetches else None
                    if f is not None and f.pending and now - f.asked >= RETRY_S:
                        f.asked = now
                        again.append((dev, job_id, f, sorted(f.pending)))
        for dev, job_id, f, indices in again:
            want = protocol.bitmap_from_indices(indices, f.blocks)
            msg = protocol.request_message(f.sha, f.size, f.block_size, want, job_id,
                                           self.fanout)
            self._publish(dev, self.topics.artifact_request(dev, f.sha), protocol.encode(msg))

    def _on_block(self, info: Any, payload: bytes, conn: int = 0) -> None:
        again = []
        with self.lock:
            if info.device or conn == 0:  # a shared block reaches every connection: once
                self.block_bytes += len(payload)
                self.block_messages += 1
            pending = self._fetches[conn]  # this connection's devices' fetches
            for (dev, job_id), fetches in pending.items():
                if info.device not in ("", dev) or not fetches:
                    continue
                f = fetches[0]
                if f.sha == info.sha256 and info.block in f.pending:
                    f.pending.discard(info.block)
                    if not f.pending:
                        again.append((dev, job_id))
        for key in again:
            self._request(*key)

    def _finish(self, dev: str, job_id: str, kind: str) -> None:
        result = {"precision": "fp16", "throughput_qps": 1000.0, "emulated": True,
                  "latency_ms": {"median": 1.0, "p99": 2.0}}
        self._status(dev, job_id, kind, "SUCCEEDED", "activating", result)
        with self.lock:
            self.succeeded += 1
            self.last_final = time.time()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--name", default="sim")
    p.add_argument("--prefix", default=DEFAULT_PREFIX)
    p.add_argument("--fetch", action="store_true", help="request every artifact's blocks")
    p.add_argument("--fanout", action="store_true", help="with --fetch: on the artifacts' "
                   "shared block topics")
    p.add_argument("--connections", type=int, metavar="N",
                   help="MQTT connections to spread the devices over (default: one per {} "
                   "devices, at most {})".format(DEVICES_PER_CONNECTION,
                                                  MAX_DEFAULT_CONNECTIONS))
    p.add_argument("--identity", metavar="KEYS_FILE", help="device keys: sign every report, "
                   "write the public keys here (for fleet serve --admission-keys)")
    p.add_argument("--no-acks", dest="acks", action="store_false", help="devices of the "
                   "release before acknowledged births: each birth published once")
    p.add_argument("--stats", metavar="FILE", help="at exit (Ctrl-C, SIGTERM), write what the "
                   "devices saw here as JSON: first and last job document received, last final "
                   "status sent (epoch seconds), jobs succeeded, CONNACKs")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *a: _interrupt())
    hostport = args.broker.split("://", 1)[-1]
    host, _, port = hostport.partition(":")
    fleet = SimulatedFleet(host, int(port or 1883), args.count, args.name, args.prefix,
                           args.fetch, args.fanout, identity=bool(args.identity),
                           connections=args.connections, acks=args.acks)
    if args.identity:
        fleet.write_keys(args.identity)
    fleet.start()
    print("{} simulated devices online over {} connections; Ctrl-C to stop".format(
        args.count, len(fleet.clients)), flush=True)
    try:
        while True:
            time.sleep(5)
            with fleet.lock:  # the network thread adds jobs meanwhile
                received = sum(len(v) for v in fleet.jobs.values())
            print("jobs received {}, succeeded {}, block bytes {}".format(
                received, fleet.succeeded, fleet.block_bytes), flush=True)
    except KeyboardInterrupt:
        fleet.stop()
    if args.stats:
        with open(args.stats + ".tmp", "w") as f:
            json.dump({"first_doc": fleet.first_doc, "last_doc": fleet.last_doc,
                       "last_final": fleet.last_final, "succeeded": fleet.succeeded,
                       "connects": fleet.connects, "acked": len(fleet.acked),
                       "births": fleet.births, "last_ack": fleet.last_ack}, f)
        os.replace(args.stats + ".tmp", args.stats)
    return 0


def _interrupt() -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
