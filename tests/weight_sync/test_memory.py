"""How much memory a weight round takes, and where (docs/weight_sync_memory.md): a streamed round's
receive areas, the same-host slot that moves to the sender's device only when a member asks for
it, and who may not join an NCCL group at all (a member on the sender's own GPU).

Everything here runs on the CPU: the streamed round goes over gloo between threads of this
process, through the same `receive_streaming` a CUDA vLLM worker runs over NCCL; the device-slot
decisions are checked with fake devices and UUIDs.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

import pytest
import torch

from weight_sync import buckets as bk
from weight_sync import receiver, shm
from weight_sync.client import GeneratorSyncClient
from weight_sync.messages import RoundInfo, SameHost
from weight_sync.receiver import RoundRefused, receive_streaming
from weight_sync.round import RoundStore, store_server
from weight_sync.sender import WeightSender
from weight_sync.slot import WeightsDamaged

KIB = 1024


def _model(layers: int = 24) -> list[tuple[str, torch.Tensor]]:
    """A model of `layers` 16 KiB matrices, a few small tensors between them, and an embedding
    larger than a bucket (it gets a bucket of its own: the largest one, 40 KiB)."""
    g = torch.Generator().manual_seed(1)
    named = [("embed", torch.randn(160, 64, generator=g))]
    for i in range(layers):
        named += [(f"layers.{i}.w", torch.randn(64, 64, generator=g)),
                  (f"layers.{i}.norm", torch.randn(64, generator=g))]
    return named + [("steps", torch.arange(3, dtype=torch.int64))]


class Recorder:
    """Stands in for `receiver._alloc`: hands out the same tensors, and knows at every moment how
    many bytes of what it handed out are still alive (a tensor is freed when its last reference
    goes, which a finalizer on it sees)."""

    def __init__(self, alloc):
        self.alloc, self.live, self.peak, self.calls = alloc, 0, 0, []

    def __call__(self, nbytes, device):
        t = self.alloc(nbytes, device)
        self.calls.append(nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._freed, nbytes)
        return t

    def _freed(self, nbytes):
        self.live -= nbytes


def _streaming_member(port: int, wid: str, out: dict, rounds: int, load_fails_at: int | None = None) -> None:
    """A generator that receives each round with `receive_streaming` into a dict standing for its
    engine's weights (a copy per tensor, as `copy_part` or `load_weights` make)."""
    ws = GeneratorSyncClient("127.0.0.1", port, wid)
    ws.register("vllm")
    engine: dict[str, torch.Tensor] = {}
    areas: list = []  # kept between rounds, as the worker keeps `_weight_sync_areas`
    got, loads = [], []
    deadline = time.monotonic() + 30
    while len(got) < rounds and time.monotonic() < deadline:
        info = ws.poll()
        if info is None:
            time.sleep(0.01)
            continue

        def load(named):
            loads.append([n for n, _ in named])
            if load_fails_at is not None and len(loads) == load_fails_at:
                raise RuntimeError("the engine refused this bucket")
            for name, t in named:
                engine[name] = t.clone()

        try:
            stats = receive_streaming(info, load, device="cpu", areas=areas)
            ws.done(info.version)
            got.append((info.version, stats, {n: t.clone() for n, t in engine.items()}))
        except Exception as e:  # noqa: BLE001 (the test looks at what it was)
            got.append((info.version, e, None))
            ws.done(info.version, ok=False)
    out.update(got=got, loads=loads, areas=areas)
    ws.close()


def _start(svc, port, wid, rounds, **kw):
    out: dict = {}
    t = threading.Thread(target=_streaming_member, args=(port, wid, out, rounds), kwargs=kw)
    t.start()
    while wid not in svc.state.generators:
        time.sleep(0.01)
    return t, out


def test_a_streamed_round_takes_two_buckets_of_memory_whatever_the_model(weight_sync_service, monkeypatch):
    """A 24-layer model in 49 buckets (the embedding's 40 KiB on its own, then per layer its
    16 KiB matrix, which fills a bucket, and its norm, which opens the next) arrives whole and bit
    for bit, yet the member never holds more than two areas of the largest bucket:
    2 x 40 KiB = 80 KiB, against 430 KiB of model. A second round reuses the same areas."""
    svc, port = weight_sync_service
    rec = Recorder(receiver._alloc)
    monkeypatch.setattr(receiver, "_alloc", rec)
    named = _model()
    t, out = _start(svc, port, "g0", rounds=2)
    sender = WeightSender("127.0.0.1", port, timeout_s=20, bucket_mb=16 / 1024, join_timeout_s=5,
                          same_host="broadcast", serve_in_background=False)
    try:
        s1 = sender.publish(1, named)
        named2 = [(n, x + 1) for n, x in named]
        while svc.state.generators["g0"].version != 1:
            time.sleep(0.01)
        s2 = sender.publish(2, named2)
        t.join(30)
    finally:
        sender.close()
    assert s1["ok"] == ["g0"] and s2["ok"] == ["g0"], (s1, s2)
    manifest = bk.plan([(n, bk.dtype_name(x.dtype), list(x.shape)) for n, x in named], 16 * KIB)
    largest, total = max(manifest.buckets), manifest.total_bytes
    assert len(manifest.buckets) == 49 and largest == 160 * 64 * 4  # the embedding: 40 KiB
    assert total > 5 * largest
    (v1, st1, w1), (v2, st2, w2) = out["got"]
    assert (v1, v2) == (1, 2) and st1["via"] == st2["via"] == "stream" and st1["buckets"] == 49
    for version, weights, ref in ((1, w1, named), (2, w2, named2)):
        assert list(weights) == [n for n, _ in ref]
        assert all(torch.equal(weights[n], x) for n, x in ref), version
    # the bound: two areas of the largest bucket, allocated once for both rounds
    assert rec.calls == [largest, largest]
    assert rec.peak == 2 * largest == st1["areas"] * st1["area_bytes"]
    # every bucket was loaded as it came, one load per bucket, in the manifest's order
    assert len(out["loads"]) == 2 * 49
    assert [n for names in out["loads"][:49] for n in names] == manifest.names


def test_a_streamed_round_broken_after_loading_began_reports_damaged_weights(weight_sync_service, monkeypatch):
    """The engine refuses bucket 5 of 49: the bytes of the round still all arrive (the sender's
    other members are not disturbed), the sender hears `err`, and the member raises
    `WeightsDamaged` ("weights damaged: ...", what the generator's hook stops on), since buckets
    1-4 of the new version are already in its weights."""
    svc, port = weight_sync_service
    t, out = _start(svc, port, "g0", rounds=1, load_fails_at=5)
    sender = WeightSender("127.0.0.1", port, timeout_s=20, bucket_mb=16 / 1024, join_timeout_s=5,
                          same_host="broadcast", serve_in_background=False, max_attempts=1)
    try:
        stats = sender.publish(1, _model())
        t.join(30)
    finally:
        sender.close()
    (version, err, _), = out["got"]
    assert isinstance(err, WeightsDamaged) and str(err).startswith("weights damaged:"), err
    assert "the engine refused" in str(err) and stats["failed"] == ["g0"]
    assert len(out["loads"]) == 5  # no load after the refused one


def test_same_device_route_table():
    """`shm.route`, every row of its table: a slot whenever one is usable (IPC first), the
    broadcast otherwise, except a member on the sender's GPU over NCCL, which is refused."""
    rows = [  # backend, same_device, shm usable, ipc usable -> route
        ("nccl", True, True, True, "ipc"), ("nccl", True, False, True, "ipc"), ("gloo", False, False, True, "ipc"),
        ("nccl", True, True, False, "shm"), ("nccl", False, True, False, "shm"), ("gloo", True, True, False, "shm"),
        ("nccl", True, False, False, "refuse"),
        ("nccl", False, False, False, "broadcast"),
        ("gloo", True, False, False, "broadcast"), ("gloo", False, False, False, "broadcast"),
    ]
    for backend, same, host, ipc, want in rows:
        assert shm.route(backend, same, host, ipc) == want, (backend, same, host, ipc)
    with pytest.raises(ValueError, match="'disk'"):
        shm.route("disk", False, False, False)
    why = shm.same_device_error(3, "GPU-1234", "/dev/shm", 16 << 30, device_slot_tried=True)
    for fix in ("GPU-1234", "/dev/shm", "--shm-size", "weight_sync.backend=gloo", "--ipc=host", str(16 << 30)):
        assert fix in why, fix


def test_join_says_the_members_device_and_old_joins_still_read():
    """`RoundStore.join` adds `dev=<uuid>` and `ipc` after the words it always had; `joined` and
    `process_of` read both forms, and `device_of` reads nothing from an old one."""
    server = store_server("127.0.0.1", 10.0)
    sender = RoundStore("127.0.0.1", server.port, 1, 5.0, "ab" * 16)
    member = RoundStore("127.0.0.1", server.port, 1, 5.0, "ab" * 16)
    member.join(1, shm=True, device="GPU-aa", ipc=True)
    member.join(2, device="GPU-bb")
    member.join(3)
    member.store.set("join/4", b"shm 4242")  # as a member of the previous version joins
    assert [sender.joined(r) for r in (1, 2, 3, 4)] == ["shm", "broadcast", "broadcast", "shm"]
    assert [sender.process_of(r) for r in (1, 2, 3, 4)] == [os.getpid(), None, None, 4242]
    assert [sender.device_of(r) for r in (1, 2, 3, 4)] == [("GPU-aa", True), ("GPU-bb", False), ("", False),
                                                           ("", False)]
    assert sender.refusal(2) is None
    sender.refuse(2, "no room")
    assert member.refusal(2) == "no room"


def _segment_manifest():
    return bk.plan([("w", "float32", [64, 64]), ("b", "float32", [64])], 8 * KIB)


def test_the_slot_moves_to_the_device_only_when_a_member_asked(tmp_path):
    """A same-host round whose members read the host file (a CPU member, or a CUDA one that does
    not see the sender's device) leaves the slot in the file, pages reserved for the gather; only
    `served(device_wanted=True)` moves it to `then` (here the CPU stands in for the sender's GPU),
    where the next `ensure` makes it and the file shrinks to the header. Without `then` (a gloo
    sender) nothing moves at all. The header names the sender's device for members to compare."""
    manifest = _segment_manifest()
    seg = shm.Segment(str(tmp_path), "t", then=torch.device("cpu"), uuid="GPU-0000-fake")
    try:
        seg.ensure(manifest)
        desc = SameHost(seg.path, seg.nonce, shm.host_id())
        assert shm.sender_uuid(desc) == "GPU-0000-fake"
        assert shm.sender_uuid(SameHost(seg.path, seg.nonce + 1, shm.host_id())) == ""  # another segment's
        seg.served()  # members read the file: it stays there, reserved for the gather
        assert seg.device is None and seg.direct and seg.slots == 2
        seg.served(device_wanted=False)
        assert seg.device is None
        seg.served(device_wanted=True)  # a member that can map a device slot asked for it
        assert seg.device == torch.device("cpu") and seg.slots == 1
        seg.ensure(manifest)
        assert seg._dev is not None and seg._dev.numel() == shm.bases(manifest)[-1]
        assert seg._mem.numel() == shm.HEADER  # the file holds the header alone
        assert shm.sender_uuid(SameHost(seg.path, seg.nonce, shm.host_id())) == "GPU-0000-fake"
    finally:
        seg.close()
    fixed = shm.Segment(str(tmp_path), "t")  # no `then`: the slot never leaves the file
    try:
        fixed.ensure(manifest)
        fixed.served(device_wanted=True)
        assert fixed.device is None and fixed.direct
    finally:
        fixed.close()


def test_a_member_on_the_senders_gpu_is_refused_the_nccl_group_and_told_why(tmp_path):
    """The sender's side of `route`: a broadcast joiner whose device UUID is the sender's own is
    kept out of the NCCL rosters. While the slot can still move to the device it is refused for
    this round only (the slot moves, it is counted missed, and catches up from the device slot);
    once the slot is on the device and it still joins the broadcast, the refusal is final and
    names the fix. Its `_attempts` raises `RoundRefused` with the sender's words. Gloo refuses
    nobody."""
    server = store_server("127.0.0.1", 10.0)
    manifest = _segment_manifest()
    sender = WeightSender("127.0.0.1", 1, timeout_s=5, serve_in_background=False, shm_dir=str(tmp_path))
    try:
        rs = RoundStore("127.0.0.1", server.port, 7, 5.0, "cd" * 16)
        rs.join(1, device="GPU-same")
        rs.join(2, device="GPU-other")
        rs.join(3)
        assert sender._same_device(rs, [1, 2, 3], manifest) == ({}, False)  # gloo: no such rule
        sender.backend, sender._device_uuid = "nccl", "GPU-same"
        sender._segment.then = torch.device("cpu")  # stands in for the sender's GPU
        assert sender._same_device(rs, [1, 2, 3], manifest) == ({1: False}, True)
        assert "offered from the next round" in rs.refusal(1) and rs.refusal(2) is None
        sender._segment.served(device_wanted=True)
        assert sender._same_device(rs, [1, 2, 3], manifest) == ({1: True}, False)
        why = rs.refusal(1)
        assert "GPU-same" in why and "--shm-size" in why and "weight_sync.backend=gloo" in why
        rs.set_roster(0, [2, 3])
        info = RoundInfo(round_id=7, version=1, backend="nccl", mode="finish", timeout_s=2.0, catch_up=False,
                         manifest=manifest, host="127.0.0.1", port=server.port, rank=1, world_size=4,
                         secret="cd" * 16)
        with pytest.raises(RoundRefused, match="NCCL refuses two ranks"):
            receiver._attempts(info, rs, 1, time.monotonic() + 2, lambda pg: None)
    finally:
        sender.close()


class _Sharded(torch.nn.Module):
    """Rank 1 of 2 of a tensor-parallel engine, as vLLM builds it: each matrix holds its half of
    the rows, and `load_weights` narrows a full tensor to them and copies at once (what vLLM's
    `ColumnParallelLinear.weight_loader` does), keeping nothing of its input."""

    def __init__(self, named):
        super().__init__()
        self.names = [n for n, _ in named]
        for name, t in named:
            shard = t.shape[0] // 2 if name.endswith(".w") else t.shape[0]
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(
                torch.zeros(shard, *t.shape[1:], dtype=t.dtype), requires_grad=False))

    def load_weights(self, weights):
        for name, t in weights:
            p = getattr(self, name.replace(".", "_"))
            p.data.copy_(t.narrow(0, p.shape[0], p.shape[0]) if name.endswith(".w") else t)


def _whole(named) -> torch.nn.Module:
    """An engine of one rank whose parameters have the round's names and shapes (a load plan fits)."""
    root = torch.nn.Module()
    for name, t in named:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
    return root


def _worker_class():
    from actors.engines.vllm.worker import WorkerExtension

    class Worker(WorkerExtension):
        """The parts of a vLLM worker `WorkerExtension` uses (its model, config, `reload_weights`)."""

        def __init__(self, model, quantization=None):
            from types import SimpleNamespace

            self.model_runner = SimpleNamespace(get_model=lambda: model)
            self.model_config = SimpleNamespace(quantization=quantization)
            self.reloaded = []

        def reload_weights(self, weights_iterator):
            self.reloaded.append([(n, t.clone()) for n, t in weights_iterator])

    return Worker


def test_a_sharded_engine_loads_its_shard_bucket_by_bucket_within_the_areas(weight_sync_service, monkeypatch):
    """The vLLM worker's streamed round (`WorkerExtension._receive_streamed`, run here on the CPU
    over gloo) into a tensor-parallel rank: no load plan fits (its parameters are shards), so each
    bucket goes through the model's `load_weights`, which keeps only this rank's rows; the round
    adds two areas of the largest bucket and nothing else. An engine of one rank is copied into
    by its load plan, bucket by bucket. A quantised engine instead stages the round in host
    buffers and calls `reload_weights` once, after the last bucket."""
    svc, port = weight_sync_service
    rec = Recorder(receiver._alloc)
    monkeypatch.setattr(receiver, "_alloc", rec)
    named = [(n, t) for n, t in _model(8) if n != "steps"]
    Worker = _worker_class()
    sharded, whole = _Sharded(named), _whole(named)
    workers = {"tp1": Worker(sharded), "one": Worker(whole), "fp8": Worker(torch.nn.Module(), quantization="fp8")}
    results = {}

    def member(wid, w):
        ws = GeneratorSyncClient("127.0.0.1", port, wid)
        ws.register("vllm")
        info = None
        while info is None:
            info = ws.poll() or time.sleep(0.01)
        results[wid] = w._receive_streamed(info, 0, "cpu", "")
        ws.done(info.version)
        ws.close()

    threads = [threading.Thread(target=member, args=item) for item in workers.items()]
    for t in threads:
        t.start()
    while len(svc.state.generators) < 3:
        time.sleep(0.01)
    sender = WeightSender("127.0.0.1", port, timeout_s=20, bucket_mb=16 / 1024, join_timeout_s=5,
                          same_host="broadcast", serve_in_background=False)
    try:
        stats = sender.publish(1, named)
        for t in threads:
            t.join(30)
    finally:
        sender.close()
    assert stats["ok"] == ["fp8", "one", "tp1"], stats
    assert {w: r["load_path"] for w, r in results.items()} == {"tp1": "load_weights", "one": "direct",
                                                                "fp8": "staged_reload_weights"}
    params = dict(whole.named_parameters())
    for name, t in named:
        want = t[t.shape[0] // 2:] if name.endswith(".w") else t
        assert torch.equal(getattr(sharded, name.replace(".", "_")), want), name
        assert torch.equal(params[name], t), name
    (reloaded,) = workers["fp8"].reloaded
    assert [n for n, _ in reloaded] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(reloaded, named))
    largest = max(bk.plan([(n, "float32", list(t.shape)) for n, t in named], 16 * KIB).buckets)
    assert rec.calls == [largest] * 6 and rec.peak == 6 * largest  # two areas per member, three members
