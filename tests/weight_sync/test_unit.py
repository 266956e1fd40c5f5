"""Weight sync without engines: bucket layout, messages, the service's decisions, one live round
between threads, and a service that keeps serving through malformed requests."""

from __future__ import annotations

import copy
import threading
import time

import msgpack
import msgspec
import pytest
import torch
import zmq

from common.config import ConfigError, load_section
from launch.ports import free_port_block
from weight_sync import buckets as bk
from weight_sync.adapter import merge_adapter
from weight_sync.client import GeneratorSyncClient, WeightSyncError, ask
from weight_sync.config import WeightSyncConfig
from weight_sync.messages import (
    Adapter,
    Done,
    Go,
    Idle,
    Member,
    Offer,
    PendingRequest,
    Poll,
    ProtocolError,
    Ready,
    Register,
    RoundInfo,
    RoundResult,
    RoundStats,
    decode,
    encode,
    round_info,
)
from weight_sync.receiver import RoundMissed, receive_named_tensors
from weight_sync.sender import WeightSender
from weight_sync.state import SyncState

# ---------------------------------------------------------------------------------------------
# buckets


def test_bucket_layout_worked_example():
    # bucket_bytes = 1024, ALIGN = 64:
    #   a float32 (10, 10) = 400 B -> bucket 0 @ 0           (bucket 0 used: 400)
    #   b bfloat16 (3,)    =   6 B -> bucket 0 @ 448          (400 rounded up to 64; used 454)
    #   c float32 (300,)   = 1200 B > 1024 -> bucket 1 of its own, exactly 1200 B
    #   d int64 (64,)      = 512 B -> bucket 0 @ 512          (454 -> 512; 512 + 512 = 1024 fits)
    #   e bool (5,)        =   5 B -> bucket 0 is full -> bucket 2 @ 0
    specs = [("a", "float32", [10, 10]), ("b", "bfloat16", [3]), ("c", "float32", [300]),
             ("d", "int64", [64]), ("e", "bool", [5])]
    m = bk.plan(specs, 1024)
    assert m.buckets == [1024, 1200, 5]
    assert [[t.bucket, t.offset] for t in m.tensors] == [[0, 0], [0, 448], [1, 0], [0, 512], [2, 0]]
    # on the wire: [name, dtype, shape, bucket, offset] per tensor, and back unchanged
    wire = msgspec.to_builtins(m)
    assert wire["tensors"][1] == ["b", "bfloat16", [3], 0, 448]
    assert msgspec.convert(wire, bk.Manifest) == m


def test_pack_unpack_round_trip_mixed_dtypes_and_oversized_tensor():
    g = torch.Generator().manual_seed(0)
    named = [
        ("embed", torch.randn(50, 40, generator=g)),  # 8000 B > bucket: a bucket of its own
        ("w_bf16", torch.randn(7, 3, generator=g).to(torch.bfloat16)),
        ("w_f16", torch.randn(5, generator=g).to(torch.float16)),
        ("steps", torch.arange(9, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(3.5)),
        ("transposed", torch.randn(6, 4, generator=g).t()),  # not contiguous
        ("f64", torch.randn(3, generator=g, dtype=torch.float64)),
    ]
    specs, tensors = bk.specs_of(named)
    m = bk.plan(specs, 4096)
    buckets = bk.pack(m, tensors)
    assert len(buckets) == 2 and sorted(b.numel() for b in buckets)[-1] == 8000
    out = bk.unpack(m, buckets)
    assert [n for n, _ in out] == [n for n, _ in named]
    for (n, want), (_, got) in zip(named, out):
        assert got.dtype == want.dtype and got.shape == want.shape, n
        assert torch.equal(got, want), n
    # views, not copies: writing the bucket changes the unpacked tensor
    buckets[0].zero_()
    assert all(float(t.float().abs().sum()) == 0 for n, t in bk.unpack(m, buckets) if {
        x.name: x.bucket for x in m.tensors}[n] == 0)


def test_manifest_validation_names_the_bad_field():
    good = msgspec.to_builtins(bk.plan([("a", "float32", [4]), ("b", "float32", [4])], 1024))
    cases = {
        "manifest.tensors[0].dtype": lambda m: m["tensors"][0].__setitem__(1, "complex32"),
        "manifest.tensors[1].offset": lambda m: m["tensors"][1].__setitem__(4, 66),  # not a multiple of 4
        "manifest.tensors[1]": lambda m: m["tensors"][1].__setitem__(4, 1024),  # ends past the bucket
        "manifest.tensors[1].name": lambda m: m["tensors"][1].__setitem__(0, "a"),  # duplicate
        "manifest.tensors[0].bucket": lambda m: m["tensors"][0].__setitem__(3, 5),
        "manifest.buckets[0]": lambda m: m["buckets"].__setitem__(0, -1),
    }
    for field, spoil in cases.items():
        m = copy.deepcopy(good)
        spoil(m)
        with pytest.raises(ProtocolError) as e:  # as a peer's `ready` carries it
            decode(msgpack.packb({"v": 1, "type": "ready", "sender_id": "l", "version": 1, "backend": "gloo",
                                  "manifest": m, "host": "127.0.0.1", "port": 1}))
        assert e.value.field == f"ready.{field}"
    # a manifest built here is checked too
    with pytest.raises(ProtocolError) as e:
        bk.Manifest([16], [bk.TensorSpec("a", "float32", [4], 0, 2)])
    assert e.value.field == "manifest.tensors[0].offset"


# ---------------------------------------------------------------------------------------------
# messages


def _manifest():
    return bk.plan([("w", "float32", [2, 2])], 1024)


def _info(**kw) -> RoundInfo:
    info = dict(round_id=1, version=3, backend="gloo", mode="finish", timeout_s=10.0, catch_up=False,
                manifest=_manifest(), bucket_bytes=16, host="127.0.0.1", port=1234, path="",
                rank=1, local_world_size=1, world_size=2)
    info.update(kw)
    return RoundInfo(**info)


def test_messages_round_trip():
    msgs = [
        Register("g0", "vllm", 2, -1),
        Poll("g0", 4),
        Offer(_info()),
        Idle(3, 0.5),
        Done("g0", 4, True, 0.25, ""),
        Ready("learner0", 4, "gloo", _manifest(), "10.0.0.1", 29500, "", True, 60.0, 5.0),
        Go(7, 4, [Member("g0", 1, 2), Member("g1", 3, 1)], 4, False, [6]),
        PendingRequest("learner0", 4, 1.0),
        RoundResult(7, 4, ["g0"], [], ["g1"], RoundStats(bytes=16, broadcast_s=0.1)),
    ]
    for m in msgs:
        assert decode(encode(m)) == m


@pytest.mark.parametrize("payload, field", [
    (b"\xc1not msgpack", "envelope"),
    (msgpack.packb([1, 2]), "envelope"),
    (msgpack.packb({"v": 99, "type": "poll"}), "envelope.v"),
    (msgpack.packb({"v": 1, "type": "launch_missiles"}), "envelope.type"),
    (msgpack.packb({"v": 1, "type": "poll", "worker_id": "g0"}), "poll.version"),
    (msgpack.packb({"v": 1, "type": "register", "worker_id": "g0", "engine_kind": "vllm", "world_size": 0,
                    "version": -1}), "register.world_size"),
    (msgpack.packb({"v": 1, "type": "done", "worker_id": "g0", "version": 1, "ok": "yes", "load_s": 0.0,
                    "error": ""}), "done.ok"),
    (msgpack.packb({"v": 1, "type": "ready", "sender_id": "l", "version": 1, "backend": "gloo",
                    "manifest": msgspec.to_builtins(_manifest()), "host": "", "port": 0, "path": "",
                    "can_catch_up": True, "timeout_s": 1.0, "join_timeout_s": 1.0}), "ready.port"),
    (msgpack.packb({"v": 1, "type": "go", "round_id": 1, "version": 1, "members": [["g0", 0, 1]],
                    "world_size": 2}), "go.members[0].first_rank"),
    (msgpack.packb({"v": 1, "type": "round", "info": {**msgspec.to_builtins(_info()), "world_size": 1}}),
     "round.info.rank"),
])
def test_malformed_messages_name_the_field(payload, field):
    with pytest.raises(ProtocolError) as e:
        decode(payload)
    assert e.value.field == field


def test_round_info_validation():
    info = _info()
    assert round_info(msgspec.to_builtins(info)) == info  # as it crosses collective_rpc, and back
    with pytest.raises(ProtocolError) as e:  # ranks 1..2 of a 2-rank world: rank 2 does not exist
        _info(local_world_size=2)
    assert e.value.field == "round_info.rank"
    with pytest.raises(ProtocolError) as e:
        _info(backend="disk", path="")
    assert e.value.field == "round_info.path"
    with pytest.raises(ProtocolError) as e:  # a plain map is checked field by field
        round_info({**msgspec.to_builtins(info), "timeout_s": -1.0})
    assert e.value.field == "round_info.timeout_s"


def test_an_adapter_round_carries_its_spec_and_merges_from_the_base():
    spec = Adapter(r=1, lora_alpha=2, target_modules=["proj"])
    ready = Ready("learner0", 4, "gloo", _manifest(), "10.0.0.1", 29500, adapter=spec)
    assert decode(encode(ready)) == ready
    info = _info(adapter=spec)
    assert round_info(msgspec.to_builtins(info)).adapter == spec  # across collective_rpc, and back
    with pytest.raises(ProtocolError) as e:
        decode(msgpack.packb({**msgspec.to_builtins(ready), "adapter": {"r": 0, "lora_alpha": 2,
                                                                      "target_modules": ["proj"]}}))
    assert e.value.field == "ready.adapter.r"

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.proj.weight.copy_(torch.eye(2))
    base: dict = {}

    def merged(b):
        named = [("base_model.model.proj.lora_A.weight", torch.tensor([[1.0, 2.0]])),  # (r, in)
                 ("base_model.model.proj.lora_B.weight", torch.tensor(b))]  # (out, r)
        assert merge_adapter(model, named, spec, base) == 1
        return model.proj.weight.tolist()

    # scale = alpha / r = 2; B @ A = [[1, 2], [0, 0]]: W = I + 2 [[1, 2], [0, 0]]
    assert merged([[1.0], [0.0]]) == [[3.0, 4.0], [0.0, 1.0]]
    # the next version is merged into the base, not into the previous version: I + 2 [[0, 0], [1, 2]]
    assert merged([[0.0], [1.0]]) == [[1.0, 0.0], [2.0, 5.0]]


def test_config_checks_quote_bad_values():
    with pytest.raises(ConfigError, match="join_timeout_s=50"):
        load_section(WeightSyncConfig, "weight_sync", None, ["--weight_sync.join_timeout_s", "50",
                                                             "--timeout_s", "10"])
    with pytest.raises(ConfigError, match="disk_dir"):
        load_section(WeightSyncConfig, "weight_sync", None, ["--backend", "disk"])
    cfg = load_section(WeightSyncConfig, "weight_sync", None, ["--bucket_mb", "64"])
    assert cfg.bucket_bytes == 64 << 20


# ---------------------------------------------------------------------------------------------
# the service's decisions (no sockets; a fake clock)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _ready(version, **kw):
    args = dict(sender_id="learner0", version=version, backend="gloo", manifest=_manifest(), host="127.0.0.1",
                port=4000, path="", can_catch_up=True, timeout_s=30.0, join_timeout_s=5.0)
    args.update(kw)
    return Ready(**args)


def test_service_rounds_ranks_versions_and_lag():
    clock = Clock()
    s = SyncState(WeightSyncConfig(stale_after_s=60), clock)
    s.handle(Register("a", "vllm", 1, -1))
    s.handle(Register("b", "vllm", 2, -1))  # a 2-worker engine: two consecutive ranks
    assert isinstance(s.handle(Poll("a", -1)), Idle)  # nothing published yet
    go = s.handle(_ready(1))
    assert go.members == [Member("a", 1, 1), Member("b", 2, 2)] and go.world_size == 4
    offer = s.handle(Poll("b", -1))
    assert isinstance(offer, Offer) and offer.info.rank == 2 and offer.info.local_world_size == 2
    assert offer.info.port == 4000 and offer.info.version == 1
    s.handle(Done("b", 1, True, 0.5, ""))
    st = s.status()
    assert st["generators"]["b"]["version"] == 1 and st["generators"]["b"]["lag"] == 0
    assert st["generators"]["a"]["lag"] == 2  # current 1 - version -1
    # a member that died mid-round is left out of the next round until it polls again
    s.handle(RoundResult(go.round_id, 1, ["b"], [], ["a"], RoundStats(bytes=16)))
    assert s.status()["last_round"]["failed"] == ["a"] and s.status()["last_round"]["bytes"] == 16
    go2 = s.handle(_ready(2))
    assert [m.worker_id for m in go2.members] == ["b"]
    # a generator silent for longer than stale_after_s is left out too
    clock.t += 61
    s.handle(Poll("b", 1))  # b is alive
    s.generators["c"] = s.generators["b"].__class__("c", "vllm", 1, -1, clock.t - 100)
    assert [m.worker_id for m in s.handle(_ready(3)).members] == ["b"]
    assert s.handle(_ready(2)).__class__.__name__ == "Error"  # versions never go back
    # a member that never joined (busy or gone) is left out until it is heard from again
    go4 = s.handle(_ready(4))
    s.handle(RoundResult(go4.round_id, 4, [], ["b"], []))
    assert s.status()["generators"]["b"]["absent"] and s.handle(_ready(5)).members == []
    s.handle(Poll("b", 1))
    assert [m.worker_id for m in s.handle(_ready(6)).members] == ["b"]


def test_service_catch_up_rounds():
    clock = Clock()
    s = SyncState(WeightSyncConfig(), clock)
    s.handle(_ready(5))  # nobody registered yet
    s.handle(Register("late", "vllm", 1, -1))
    # the sender has not said it is serving catch-ups: the newcomer waits for the next publish
    assert isinstance(s.handle(Poll("late", -1)), Idle)
    assert isinstance(s.handle(PendingRequest("learner0", 5, 1.0)), Idle)  # nothing pending, but now serving
    offer = s.handle(Poll("late", -1))
    assert isinstance(offer, Offer) and offer.info.catch_up and offer.info.version == 5
    go = s.handle(PendingRequest("learner0", 5, 1.0))
    assert isinstance(go, Go) and go.catch_up and go.members == [Member("late", 1, 1)]
    # the serving promise lapses: no more offers that nobody would serve
    clock.t += 5
    s.handle(Register("later", "vllm", 1, -1))
    assert isinstance(s.handle(Poll("later", -1)), Idle)
    # an unclaimed catch-up round is cancelled by the next publish, whose round includes its member
    s.handle(PendingRequest("learner0", 5, 1.0))
    forming = s.handle(Poll("later", -1)).info.round_id
    go6 = s.handle(_ready(6))
    assert go6.cancelled == [forming] and "later" in [m.worker_id for m in go6.members]
    # disk: the service answers catch-ups by itself, from the latest folder
    s.handle(_ready(7, backend="disk", host="", port=0, path="/shared/v7", can_catch_up=False))
    s.handle(Register("disk_reader", "transformers", 1, -1))
    info = s.handle(Poll("disk_reader", -1)).info
    assert info.backend == "disk" and info.path == "/shared/v7" and info.catch_up


# ---------------------------------------------------------------------------------------------
# sockets: a live service


def test_malformed_control_messages_get_errors_and_service_keeps_serving(weight_sync_service):
    svc, port = weight_sync_service
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")

    def send_raw(frames):
        sock.send_multipart(frames)
        assert sock.poll(5000), "the service stopped answering"
        empty, body = sock.recv_multipart()
        return decode(body)

    bad = [
        ([b"", b"\xc1garbage"], "envelope"),
        ([b"", msgpack.packb({"v": 2, "type": "status_request"})], "envelope.v"),
        ([b"", msgpack.packb({"v": 1, "type": "poll", "worker_id": "ghost", "version": 0})], "poll.worker_id"),
        ([b"", msgpack.packb({"v": 1, "type": "register", "worker_id": "", "engine_kind": "vllm",
                              "world_size": 1, "version": -1})], "register.worker_id"),
        ([b"", encode(Idle(1, 0.5))], "envelope.type"),  # a reply sent as a request
        ([b"", b"x", b"y"], "message"),  # wrong frame count
    ]
    for frames, field in bad:
        reply = send_raw(frames)
        assert type(reply).__name__ == "Error" and reply.field == field, (field, reply)
    # still serving, and counted the errors
    ws = GeneratorSyncClient("127.0.0.1", port, "g0")
    assert ws.register("vllm") == {"current_version": -1, "mode": "finish"}
    assert ws.status()["errors"] == len(bad)
    with pytest.raises(WeightSyncError) as e:
        ask(ws.channel, Register("", "vllm", 1, -1))
    assert e.value.field == "register.worker_id"
    sock.close(0)


def test_publish_without_service_returns_within_timeout():
    port = free_port_block(1)  # nobody listens here
    sender = WeightSender("127.0.0.1", port, timeout_s=1.0, join_timeout_s=0.5, serve_in_background=False)
    t0 = time.monotonic()
    stats = sender.publish(1, [("w", torch.ones(4))])
    assert time.monotonic() - t0 < 2.0
    assert stats["error"].startswith("service:") and stats["ok"] == []
    sender.close()


def test_round_between_threads_multi_bucket_and_late_joiner(weight_sync_service):
    """Sender and two receivers in threads of this process (gloo between threads works too)."""
    svc, port = weight_sync_service
    named = [(f"layer{i}.w", torch.randn(64, 64)) for i in range(6)] + [("emb", torch.randn(300, 64))]
    results: dict[str, list] = {}

    def generator(wid, rounds):
        ws = GeneratorSyncClient("127.0.0.1", port, wid)
        ws.register("transformers")
        got = []
        deadline = time.monotonic() + 20
        while len(got) < rounds and time.monotonic() < deadline:
            info = ws.poll() or (ws.wait_current(10) if ws.version < ws.current_version else None)
            if info is None:
                time.sleep(0.02)
                continue
            tensors, stats = receive_named_tensors(info)
            ws.done(info.version)
            got.append((info.version, info.catch_up, all(torch.equal(a, b) for (_, a), (_, b)
                                                                 in zip(tensors, named)), stats["buckets"]))
        results[wid] = got
        ws.close()

    threads = [threading.Thread(target=generator, args=(w, 1)) for w in ("g0", "g1")]
    for t in threads:
        t.start()
    while len(svc.state.generators) < 2:
        time.sleep(0.01)
    # 16 KiB buckets: six 16 KiB layers one per bucket, the 75 KiB embedding in its own
    sender = WeightSender("127.0.0.1", port, timeout_s=20, bucket_mb=16 / 1024, join_timeout_s=5,
                          serve_interval_s=0.05)
    stats = sender.publish(1, named)
    for t in threads:
        t.join(20)
    assert stats["ok"] == ["g0", "g1"] and stats["failed"] == [] and stats["buckets"] == 7
    assert results["g0"] == [(1, False, True, 7)] and results["g1"] == [(1, False, True, 7)]
    # a generator that registers after the publish is caught up by the sender's background thread
    late = threading.Thread(target=generator, args=("late", 1))
    late.start()
    late.join(20)
    assert results["late"] == [(1, True, True, 7)]
    st = GeneratorSyncClient("127.0.0.1", port, "x").status()
    assert {w: g["version"] for w, g in st["generators"].items()} == {"g0": 1, "g1": 1, "late": 1}
    assert st["max_lag"] == 0 and st["catch_up_rounds"] == 1
    sender.close()


def test_receiver_left_out_raises_round_missed(weight_sync_service):
    svc, port = weight_sync_service
    sender = WeightSender("127.0.0.1", port, timeout_s=5, join_timeout_s=0.3, serve_in_background=False)
    ws = GeneratorSyncClient("127.0.0.1", port, "slow")
    ws.register("transformers")
    outcome = {}

    def slow_generator():
        info = None
        while info is None:
            info = ws.poll()
        time.sleep(1.0)  # still finishing its batch when the join window (0.3 s) closes
        try:
            receive_named_tensors(info)
            outcome["got"] = "weights"
        except RoundMissed as e:
            outcome["got"] = f"missed: {e}"

    t = threading.Thread(target=slow_generator)
    t.start()
    stats = sender.publish(1, [("w", torch.ones(8))])
    t.join(10)
    assert stats["missed"] == ["slow"] and stats["ok"] == [] and stats["join_s"] < 1.0
    assert outcome["got"].startswith("missed: rank 1: left out of round")
    # nobody serves catch-up rounds (no background thread, no serve_pending): a newcomer's
    # wait_current gives up after its timeout and the generator starts on its own weights
    newbie = GeneratorSyncClient("127.0.0.1", port, "newbie")
    newbie.register("transformers")
    t0 = time.monotonic()
    assert newbie.wait_current(0.6) is None and newbie.current_version == 1
    assert time.monotonic() - t0 < 1.5
    # serve_pending (what the learner calls each step without the thread) makes the offer real
    sender.serve_pending()  # says "serving"; nothing pending yet
    info = newbie.poll()
    assert info is not None and info.catch_up
    got = {}
    t = threading.Thread(target=lambda: got.update(r=receive_named_tensors(info)))
    t.start()
    stats = sender.serve_pending()
    t.join(10)
    assert stats["ok"] == ["newbie"] and stats["catch_up"]
    assert torch.equal(got["r"][0][0][1], torch.ones(8))
    sender.close()


def test_huge_shapes_are_refused_before_any_arithmetic():
    # a shape of 65,535 dims of 2**64-1 once cost seconds of big-integer products
    for shape in ([2**64 - 1] * 65535 + [0], [1] * 131072, [2**40, 0], [-1], ["8"]):
        payload = msgpack.packb({"v": 1, "type": "ready", "sender_id": "l", "version": 1, "backend": "gloo",
                                 "manifest": {"buckets": [4096], "tensors": [["w", "float32", shape, 0, 0]]},
                                 "host": "127.0.0.1", "port": 1})
        t0 = time.monotonic()
        with pytest.raises(ProtocolError) as e:
            decode(payload)
        assert time.monotonic() - t0 < 0.5
        assert e.value.field == "ready.manifest.tensors[0].shape"


def test_the_rendezvous_keys_are_under_the_senders_secret():
    """A member given the round's secret meets the sender; a peer of the store without it sees
    none of the round's keys (a TCPStore cannot list them), so it cannot join a roster or a group."""
    from weight_sync.round import RoundStore, store_server

    server = store_server("127.0.0.1", 10.0)
    secret = "5e" * 16
    sender = RoundStore("127.0.0.1", server.port, 3, 5.0, secret)
    member = RoundStore("127.0.0.1", server.port, 3, 5.0, secret)
    stranger = RoundStore("127.0.0.1", server.port, 3, 5.0)
    member.join(1)
    stranger.join(2)
    assert sender.joined(1) == "broadcast" and sender.joined(2) is None and stranger.joined(1) is None
    with pytest.raises(ProtocolError, match="secret"):
        decode(encode(Ready("learner0", 1, "gloo", _manifest(), "h", 1, secret="not hex!")))


def test_the_hook_keeps_serving_old_weights_but_stops_on_damaged_ones_or_a_fatal_refusal():
    """A round that was not loaded leaves the old weights (the hook reports it and goes on); one
    whose in-place load left a mixture (`WeightsDamaged`, as the engine's workers raise it) stops
    the generator, after reporting, so its supervisor restarts it."""
    from types import SimpleNamespace

    from actors.weight_hook import WeightSyncHook
    from weight_sync.slot import WeightsDamaged

    done = []
    ws = SimpleNamespace(done=lambda version, **kw: done.append((version, kw["ok"])))

    class Engine:
        def __init__(self, error):
            self.error = error

        def receive_weights(self, info):
            raise self.error

    hook = WeightSyncHook(ws)
    info = SimpleNamespace(version=7, mode="finish")
    hook.apply(Engine(RuntimeError("rank 0: left out of round 3")), info)
    with pytest.raises(RuntimeError, match="weights damaged"):  # across collective_rpc: its text
        hook.apply(Engine(RuntimeError(str(WeightsDamaged("weights damaged: v7 was overwritten")))), info)
    # left out for one round while the slot moves to the learner's GPU: it goes on
    from weight_sync.receiver import RoundRefused
    from weight_sync.shm import same_device_error

    hook.apply(Engine(RuntimeError(str(RoundRefused("rank 1: left out of round 4: its engine is on GPU u, the GPU "
                                                    "of learner rank 0, where NCCL cannot reach it")))), info)
    # on learner rank 0's GPU with no slot it can use: no round can ever reach it, it stops and says why
    with pytest.raises(RuntimeError, match="Fix: give /dev/shm room"):
        hook.apply(Engine(RuntimeError(str(RoundRefused(same_device_error(1, "u", "/dev/shm", 1 << 30, True))))), info)
    assert done == [(7, False)] * 4


def test_a_tensor_parallel_engine_whose_ranks_disagree_after_a_failed_round_stops():
    """Each tensor-parallel worker is a member of its own: one can load a round another was left
    out of. After a failed round the engine asks every worker which version it holds; shards of two
    versions are "weights damaged" (fatal), one version is the old weights (the round's error stands)."""
    from actors.engines.vllm.engine import _VLLMBackend
    from weight_sync.receiver import fatal

    class Workers(_VLLMBackend):  # the check alone, no engine behind it
        generate = receive_weights = None

    def engine(tp: int, held: list[int]):
        e = object.__new__(Workers)
        e.tensor_parallel_size = tp
        e._rpc = lambda method, args: held if method == "held_version" else pytest.fail(method)
        return e

    left_out = RuntimeError("rank 1: left out of round 4 (attempt 0)")
    with pytest.raises(RuntimeError) as err:
        engine(2, [5, 4])._ranks_agree(left_out)
    assert fatal(str(err.value)) and "[5, 4]" in str(err.value)
    engine(2, [4, 4])._ranks_agree(left_out)  # every worker kept v4: nothing to stop for
    engine(1, [])._ranks_agree(left_out)  # one worker: nothing to compare
