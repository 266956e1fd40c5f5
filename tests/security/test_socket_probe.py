"""What a probe of the services' sockets found, sent again: each input once crashed, stalled or
bloated the buffer or the weight-sync service. Each test starts the real process, sends the input
with raw sockets, and asserts that the process is alive, answers a valid request, and counted the
refusal (buffer metrics, weight-sync status counters).

Raw ZMTP (`_zmtp_peer`) is needed for the memory cases: a libzmq sender keeps a multipart message
to itself until its last frame, so only a hand-made peer can send frames that never end.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time

import msgpack
import numpy as np
import psutil
import pytest
import zmq

from buffer.client import BufferClient
from buffer.messages import BatchRequest, Error, MetricsRequest, Rollout, decode, encode
from launch.ports import free_port_block
from tests.helpers.buffer import answer, scored, start_buffer
from tests.helpers.procs import ROOT, subprocess_env
from weight_sync import messages as wsm
from weight_sync.client import GeneratorSyncClient

MB = 1 << 20
# a list nested 1,000 deep: msgpack unpacks it (its limit is 1,024), Python's repr of it recurses too deep
DEEP = b"\x91" * 1000 + b"\x90"


def _map(**fields) -> bytes:
    """A msgpack map whose values are already-packed bytes (so one can be `DEEP`)."""
    out = bytes([0x80 | len(fields)])
    for k, v in fields.items():
        out += msgpack.packb(k) + v
    return out


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MB


# ---- raw ZMTP 3.0, NULL mechanism ---------------------------------------------------------------


def _zmtp_peer(port: int, socket_type: bytes) -> socket.socket:
    """A TCP connection that has done the ZMTP handshake as a `socket_type` peer."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
    got = b""
    while len(got) < 64:
        got += s.recv(64 - len(got))
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    return s


def _more_frame(n: int) -> bytes:
    """One frame of `n` bytes with the MORE flag: the message goes on."""
    return b"\x03" + struct.pack(">Q", n) + b"x" * n


def _send_never_ending(port: int, socket_type: bytes, total_mb: int, hold_s: float = 30.0) -> None:
    """`total_mb` MiB of 1 MiB frames, every one flagged MORE, then the connection held open (as an
    attacker would: libzmq frees a partial message when its peer hangs up, so a sender that closed
    would let the service off). Returns once the service hangs up; asserts it did within `hold_s`."""
    s = _zmtp_peer(port, socket_type)
    frame = _more_frame(MB)
    dropped = False
    try:
        for _ in range(total_mb):
            s.sendall(frame)
        s.settimeout(hold_s)
        while s.recv(65536):  # (whatever the service says) until it hangs up
            pass
        dropped = True
    except TimeoutError:
        pass
    except OSError:  # the service dropped the connection: what the memory guard does
        dropped = True
    finally:
        s.close()
    assert dropped, f"the service held a never-ending message for {hold_s} s without dropping it"


def _until_memory_reset(pid: int, rss0_mb: float, resets, timeout_s: float = 30.0) -> None:
    """Poll until the service at `pid` has counted a memory reset (`resets()`) and is back within
    300 MiB of `rss0_mb`; assert both. A status request in flight when the service drops every
    connection is lost (as the reset says): it times out and is asked again."""
    def count() -> int:
        try:
            return resets()
        except TimeoutError:
            return 0

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if count() >= 1 and _rss_mb(pid) - rss0_mb < 300:
            break
        time.sleep(0.1)
    assert resets() >= 1
    assert _rss_mb(pid) - rss0_mb < 300


# ---- the weight-sync service as a process ----------------------------------------------------


class WeightSyncProc:
    def __init__(self, tmp_path):
        for _ in range(3):
            self.port = free_port_block(1)
            self.log = tmp_path / f"weight_sync-{self.port}.log"
            self.proc = subprocess.Popen([sys.executable, "-m", "launch.weight_sync", "--weight_sync.port",
                                          str(self.port)], cwd=ROOT, env=subprocess_env(),
                                         stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:  # ready: the port answers
                    self.status(timeout_s=0.5)
                    return
                except (TimeoutError, OSError):
                    pass
            self.stop()
        raise RuntimeError(f"weight-sync service did not start:\n{self.log.read_text()}")

    def status(self, timeout_s: float = 5.0) -> dict:
        with GeneratorSyncClient("127.0.0.1", self.port, "observer", timeout_s=timeout_s) as c:
            return c.status()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture
def buffer(tmp_path):
    """`buffer(**cfg)` starts a buffer process; whatever a test started is stopped when it ends."""
    started = []

    def start(**cfg):
        started.append(start_buffer(tmp_path, **cfg))
        return started[-1]

    yield start
    for b in started:
        b.stop()


@pytest.fixture
def weight_sync(tmp_path):
    ws = WeightSyncProc(tmp_path)
    yield ws
    ws.stop()


def _ws_request(port: int, payload: bytes, timeout_s: float = 10.0) -> object:
    """Send one raw payload to the weight-sync service; its decoded reply."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        s.send_multipart([b"", payload])
        assert s.poll(int(timeout_s * 1000)), "no reply"
        return wsm.decode(s.recv_multipart()[1])
    finally:
        s.close()


def _ready_payload(version: int, shape: list) -> bytes:
    manifest = {"buckets": [4096], "tensors": [["w", "float32", shape, 0, 0]]}
    return msgpack.packb({"v": 1, "type": "ready", "sender_id": "learner0", "version": version, "backend": "gloo",
                          "manifest": manifest, "host": "127.0.0.1", "port": 1, "path": "", "can_catch_up": False,
                          "timeout_s": 5.0, "join_timeout_s": 1.0})


# ---- 1. deep nesting and odd types: a counted refusal, never an exception ----------------------


def test_deep_nesting_is_refused_on_every_buffer_socket(buffer):
    b = buffer(prompts_per_step=1, n_samples_per_prompt=1)
    ctx = zmq.Context.instance()
    deep_v = _map(v=DEEP, type=msgpack.packb("scored"), n=msgpack.packb(0))
    deep_type = _map(v=msgpack.packb(1), type=DEEP)
    map_type = _map(v=msgpack.packb(1), type=msgpack.packb({"a": 1}))
    scorer = BufferClient(port=b.port, timeout_s=10)
    scorer.pull_rollouts(timeout_s=0.2)  # connects: the relay reads only while someone can take its output
    try:
        pushes = {}
        for name, offset in (("relay_in", 2), ("ingest", 1)):
            s = pushes[name] = ctx.socket(zmq.PUSH)
            s.connect(f"tcp://127.0.0.1:{b.port + offset}")
            for payload in (deep_v, deep_type, map_type):
                s.send(payload)
        control = ctx.socket(zmq.DEALER)
        control.connect(f"tcp://127.0.0.1:{b.port}")
        for payload in (deep_v, deep_type, map_type):
            control.send_multipart([b"", payload])
            assert control.poll(10_000)
            reply = decode(control.recv_multipart()[1:])
            assert isinstance(reply, Error) and reply.field.startswith("envelope"), reply
            assert len(reply.message) < 300
        control.send_multipart([b"", *encode(MetricsRequest())])
        assert control.poll(10_000)

        with b.client() as c:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                m = c.metrics()
                if m.get("buffer/malformed_relay", 0) >= 3 and m.get("buffer/malformed_ingest", 0) >= 3:
                    break
                time.sleep(0.05)
            counted = [m[f"buffer/malformed_{where}"] for where in ("control", "ingest", "relay")]
            assert counted == [3, 3, 3]
            assert m["buffer/internal_errors"] == 0
            # a valid request is served afterwards, and the relay still forwards
            grant = c.lease("gen")
            assert answer(c, grant).accepted == 1
            r = Rollout(7, 0, 7, np.array([1]), np.array([2]), np.zeros(1), np.zeros(1), worker_id="gen")
            c.push_rollouts([r])
            got = []
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                got = scorer.pull_rollouts(timeout_s=0.5)
            assert [x.group_id for x in got] == [7]
        assert b.proc.poll() is None
        for s in (*pushes.values(), control):
            s.close(0)
    finally:
        scorer.close()
        assert b.stop() == 0


def test_deep_nesting_and_odd_types_are_refused_by_weight_sync(weight_sync):
    bad = [
        _map(v=DEEP, type=msgpack.packb("status_request")),
        _map(v=msgpack.packb(1), type=DEEP),
        _map(v=msgpack.packb(1), type=msgpack.packb([1, 2])),
        _map(v=msgpack.packb(1), type=msgpack.packb({"a": 1})),
        # a deep value stored in the status would break every later status reply
        _map(v=msgpack.packb(1), type=msgpack.packb("round_result"), round_id=msgpack.packb(1),
             version=msgpack.packb(1), ok=b"\x90", missed=b"\x90", failed=b"\x90", stats=_map(x=DEEP)),
    ]
    for payload in bad:
        reply = _ws_request(weight_sync.port, payload)
        assert isinstance(reply, wsm.Error), reply
        assert len(reply.message) < 300
    with GeneratorSyncClient("127.0.0.1", weight_sync.port, "gen0") as c:
        assert c.register("transformers")["current_version"] == -1
        assert c.poll() is None
        st = c.status()
    assert st["malformed"] == len(bad)
    assert st["internal_errors"] == 0
    assert weight_sync.proc.poll() is None


# ---- 2. a stranger on relay_out ------------------------------------------------------------------


def _big_rollout(gid: int, t: int) -> Rollout:
    return Rollout(gid, 0, gid, np.array([1]), np.zeros(t), np.zeros(t), np.zeros(t), worker_id="gen")


def test_a_stranger_on_relay_out_strands_little_and_the_scorer_gets_the_rest(buffer):
    b = buffer()
    ctx = zmq.Context.instance()
    rss0 = _rss_mb(b.proc.pid)
    gen = BufferClient(port=b.port, timeout_s=10)
    # a PULL peer that takes two messages, then stops reading (its own queue and TCP buffers small)
    stranger = ctx.socket(zmq.PULL)
    stranger.setsockopt(zmq.RCVHWM, 1)
    stranger.setsockopt(zmq.RCVBUF, 4096)
    stranger.connect(f"tcp://127.0.0.1:{b.port + 3}")
    time.sleep(0.3)
    t = MB // 12  # ~1 MiB per message
    for gid in range(2):
        gen.push_rollouts([_big_rollout(gid, t)])
    for _ in range(2):
        assert stranger.poll(10_000)
        stranger.recv_multipart()
    for gid in range(2, 120):  # the buffer may hold only a few of these for the stranger
        gen.push_rollouts([_big_rollout(gid, t)])
    time.sleep(2.0)
    held_mb = _rss_mb(b.proc.pid) - rss0
    stranger.close(0)  # ... and hangs up: what it was sent is lost with it (leases expire)
    time.sleep(0.3)

    scorer = BufferClient(port=b.port, timeout_s=10)
    scorer.pull_rollouts(timeout_s=0.01)  # connects
    time.sleep(0.3)
    after = list(range(1000, 1010))
    for gid in after:
        gen.push_rollouts([_big_rollout(gid, 16)])
    got = set()
    deadline = time.monotonic() + 15
    while not set(after) <= got and time.monotonic() < deadline:
        got |= {r.group_id for r in scorer.pull_rollouts(timeout_s=0.5)}
    assert set(after) <= got, sorted(set(after) - got)
    # 118 MiB went to a peer that did not read; the buffer kept a few of them, not all
    assert held_mb < 60, held_mb
    with b.client() as c:
        m = c.metrics()
    assert m["buffer/internal_errors"] == 0
    assert b.proc.poll() is None
    gen.close()
    scorer.close()
    assert b.stop() == 0


# ---- 3. huge tensor shapes: refused at once, the current version kept ------------------------


def test_huge_shapes_are_refused_at_once_and_keep_the_current_version(weight_sync):
    assert isinstance(_ws_request(weight_sync.port, _ready_payload(1, [8, 8])), wsm.Go)
    for shape in ([2**64 - 1] * 65535 + [0], [1] * 131072, [2**40, 0], [-1]):
        t0 = time.monotonic()
        reply = _ws_request(weight_sync.port, _ready_payload(2, shape))
        assert isinstance(reply, wsm.Error) and reply.field == "ready.manifest.tensors[0].shape", reply
        assert time.monotonic() - t0 < 2.0  # it took 10.7 s and 41 s before the bounds
    st = weight_sync.status()
    assert st["current_version"] == 1
    assert st["malformed"] == 4
    assert weight_sync.proc.poll() is None


# ---- 4. memory: frames that never end, replies nobody reads ------------------------------------


@pytest.mark.parametrize("offset, peer_type", [(0, b"DEALER"), (1, b"PUSH")], ids=["control", "ingest"])
def test_a_multipart_message_that_never_ends_is_bounded(buffer, offset, peer_type):
    b = buffer()
    rss0 = _rss_mb(b.proc.pid)
    # the buffer's budget is two of its biggest messages (512 MiB) past its size at start
    _send_never_ending(b.port + offset, peer_type, 800)
    with b.client(timeout_s=3.0) as c:
        _until_memory_reset(b.proc.pid, rss0, lambda: c.metrics()["buffer/memory_resets"])
        grant = c.lease("gen")  # served as before
        assert answer(c, grant).accepted == grant.n_samples * len(grant.groups)
    assert b.proc.poll() is None
    assert b.stop() == 0


def test_weight_sync_multipart_message_that_never_ends_is_bounded(weight_sync):
    rss0 = _rss_mb(weight_sync.proc.pid)
    _send_never_ending(weight_sync.port, b"DEALER", 400)  # its budget: 256 MiB
    _until_memory_reset(weight_sync.proc.pid, rss0, lambda: weight_sync.status()["memory_resets"])
    assert isinstance(_ws_request(weight_sync.port, _ready_payload(1, [8, 8])), wsm.Go)
    assert weight_sync.proc.poll() is None


def test_unread_replies_do_not_pile_up(buffer):
    # one step's batch of 64 rollouts of ~16 KiB: ~1 MiB per reply, asked for 800 times, never read
    b = buffer(prompts_per_step=8, n_samples_per_prompt=8, max_staleness=4)
    with b.client() as c:
        grant = c.lease("gen", max_groups=8)
        assert c.submit_scored([scored(g.group_id, i, grant.lease_id, t=1400)
                                for g in grant.groups for i in range(8)]).accepted == 64
        assert len(c.get_batch(0).scored) == 64
    rss0 = _rss_mb(b.proc.pid)
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.connect(f"tcp://127.0.0.1:{b.port}")
    for _ in range(800):
        s.send_multipart([b"", *encode(BatchRequest(0))])
    time.sleep(2.0)  # time to read and answer all 800
    with b.client() as c:
        m = c.metrics()
    grown = _rss_mb(b.proc.pid) - rss0
    assert grown < 200, grown  # 835 MB before: every unread reply was kept (16 per peer now, ~1 MiB each)
    assert m["buffer/internal_errors"] == 0
    s.close(0)
    assert b.proc.poll() is None
    assert b.stop() == 0


# ---- 5. weight-sync warnings rate-limited; the rendezvous store listens where it was told ---------


def test_the_rendezvous_store_listens_on_the_given_host_only():
    from weight_sync.round import store_server as _store_server

    store = _store_server("127.0.0.1", 5.0)
    listening = [c.laddr for c in psutil.Process().net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert [a.ip for a in listening] == ["127.0.0.1"]
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for ip in others:  # reachable before on every interface; refused now
        with pytest.raises(OSError):
            socket.create_connection((ip, store.port), timeout=1).close()
    store.set("k", b"v")
    assert store.get("k") == b"v"


def test_weight_sync_warnings_are_rate_limited(weight_sync):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{weight_sync.port}")
    for _ in range(500):
        s.send_multipart([b"", b"\xc1 not msgpack"])
    for _ in range(500):
        assert s.poll(10_000)
        s.recv_multipart()
    s.close(0)
    assert weight_sync.status()["malformed"] == 500
    # (the log is the thing being bounded here: 500 refusals, a handful of lines)
    refused = [line for line in weight_sync.log.read_text().splitlines() if "refused a request" in line]
    assert 1 <= len(refused) <= 5
