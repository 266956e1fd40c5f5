"""The same-host path (weight_sync/shm.py) and the round's data plane around it: the segment's
seqlock, the shared-memory round against the broadcast round, and a member that never answers.

Sender, service and members run in threads of this process (gloo between threads works too).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from weight_sync import buckets as bk
from weight_sync import shm
from weight_sync.client import GeneratorSyncClient
from weight_sync.messages import SameHost
from weight_sync.receiver import receive_buckets
from weight_sync.round import RoundMissed, RoundStore
from weight_sync.sender import WeightSender


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    # tensors of several sizes and dtypes, over more than one bucket of 1 MiB
    return ([("emb", torch.randn(600, 512, generator=g)), ("norm0", torch.randn(512, generator=g)),
             ("norm1", torch.randn(7, generator=g)), ("w", torch.randn(512, 520, generator=g).bfloat16()),
             ("steps", torch.arange(5, dtype=torch.int64))])


def test_gather_writes_into_the_previous_buckets_and_replans_when_the_model_changes():
    named = _named()
    manifest, buckets = bk.gather(iter(named), 1 << 20)  # first publish: copied aside, planned, packed
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bk.unpack(manifest, buckets), named))
    assert all(b.data_ptr() != t.data_ptr() for b in buckets for _, t in named)  # its own copy
    assert bk.targets(manifest, buckets) == [buckets[b] for b in bk.sent(manifest)]
    ptrs = [b.data_ptr() for b in buckets]

    def transient():  # each tensor overwritten once the next is asked for, as a ZeRO-3 gather frees it
        for name, t in named:
            live = (t * 2 if t.dtype != torch.int64 else t + 1)
            yield name, live
            live.zero_()

    again, buckets2 = bk.gather(transient(), 1 << 20, (manifest, buckets))
    assert again is manifest and [b.data_ptr() for b in buckets2] == ptrs  # in place: no new memory
    for (_, got), (_, t) in zip(bk.unpack(manifest, buckets2), named):
        assert torch.equal(got, t * 2 if t.dtype != torch.int64 else t + 1)
    # another model (a tensor more, one reshaped): a new layout, every value right
    other = named[:2] + [("norm1", torch.randn(9))] + named[3:] + [("extra", torch.ones(3))]
    m3, b3 = bk.gather(iter(other), 1 << 20, (manifest, buckets2))
    assert m3.names == [n for n, _ in other]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bk.unpack(m3, b3), other))
    m4, b4 = bk.gather(iter(other[:2]), 1 << 20, (m3, b3))  # fewer tensors
    assert m4.names == ["emb", "norm0"]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bk.unpack(m4, b4), other[:2]))


def test_segment_round_trip_and_the_seqlock(tmp_path):
    named = _named()
    manifest, buckets = bk.gather(named, 1 << 20)
    seg = shm.Segment(str(tmp_path), "test")
    try:
        seg.ensure(manifest)
        desc = SameHost(seg.path, seg.nonce, shm.host_id())
        assert shm.usable(desc)
        assert not shm.usable(SameHost(seg.path, seg.nonce + 1, shm.host_id()))  # another sender's segment
        assert not shm.usable(SameHost(seg.path, seg.nonce, "elsewhere/boot"))
        with pytest.raises(RoundMissed):
            shm.usable(SameHost(str(tmp_path / "missing"), 1, shm.host_id(), force=True))
        for version in (3, 4):  # slots 1 and 0
            seg.write(version, manifest, buckets)
            bufs = [torch.zeros(n, dtype=torch.uint8) for n in manifest.buckets]
            shm.read(desc, version, manifest, bufs)
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bk.unpack(manifest, bufs), named))
        with pytest.raises(RoundMissed, match="holds v3"):
            shm.read(desc, 5, manifest, bufs)  # slot 1 still holds v3
        words = seg._mem[:shm.HEADER].view(torch.int64)
        words[shm._SEQ] += 1  # slot 0 (v4) being written: odd seq
        with pytest.raises(RoundMissed):
            shm.read(desc, 4, manifest, bufs)
    finally:
        seg.close()


def test_a_device_slot_is_refused_by_a_cpu_member_and_its_handle_is_bounded(tmp_path):
    """A segment whose slot is on the sender's CUDA device (`SameHost.ipc`) is not for a member
    receiving onto the CPU (it takes the broadcast), nor for one whose handle cannot be mapped."""
    seg = shm.Segment(str(tmp_path), "test")
    try:
        seg.ensure(bk.gather(_named(), 1 << 20)[0])
        desc = SameHost(seg.path, seg.nonce, shm.host_id(), ipc=b"\x93not a handle")
        assert shm.usable(SameHost(seg.path, seg.nonce, shm.host_id()), "cuda:0")  # a host slot serves CUDA too
        assert not shm.usable(desc, "cpu")
        assert not shm.usable(desc, "cuda:0")  # the handle does not map (no such device or no CUDA)
        with pytest.raises(RoundMissed, match="cannot be used"):
            shm.usable(SameHost(seg.path, seg.nonce, shm.host_id(), force=True, ipc=b"x"), "cpu")
    finally:
        seg.close()


def _read_device_slot(desc: SameHost, version: int, manifest, q) -> None:
    bufs = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in manifest.buckets]
    ok = shm.usable(desc, "cuda")
    if ok:
        shm.read(desc, version, manifest, bufs)
    q.put((ok, [b.cpu() for b in bufs]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device")
def test_cuda_ipc_slot_delivers_the_version_to_another_process(tmp_path):
    """GPU: the slot on the sender's device, mapped by another process through its IPC handle,
    delivers the version bit for bit, device to device."""
    import multiprocessing as mp

    named = _named()
    manifest, buckets = bk.gather(named, 1 << 20)
    seg = shm.Segment(str(tmp_path), "test", torch.device("cuda", 0))
    try:
        seg.write(6, manifest, buckets)
        assert seg.ipc and seg.slots == 1
        desc = SameHost(seg.path, seg.nonce, shm.host_id(), ipc=seg.ipc)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_read_device_slot, args=(desc, 6, manifest, q))
        p.start()
        ok, bufs = q.get(timeout=120)
        p.join(30)
        assert ok
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bk.unpack(manifest, bufs), named))
    finally:
        seg.close()


def _member(port: int, wid: str, out: dict, rounds: int = 1) -> None:
    ws = GeneratorSyncClient("127.0.0.1", port, wid)
    ws.register("transformers")
    deadline = time.monotonic() + 30
    got = []
    while len(got) < rounds and time.monotonic() < deadline:
        info = ws.poll()
        if info is None:
            time.sleep(0.01)
            continue
        bufs, stats = receive_buckets(info)
        ws.done(info.version)
        got.append((info.version, stats["via"], [b.clone() for b in bufs]))
    out[wid] = got
    ws.close()


def _start_member(svc, port: int, wid: str, rounds: int) -> tuple[threading.Thread, dict]:
    """`_member` in a thread, once the service knows it; (thread, its results by worker id)."""
    out: dict = {}
    t = threading.Thread(target=_member, args=(port, wid, out, rounds))
    t.start()
    while wid not in svc.state.generators:
        time.sleep(0.01)
    return t, out


def test_shared_memory_round_is_bit_identical_to_the_broadcast_round(weight_sync_service):
    """Same version, two rounds: the first through the broadcast (same_host='broadcast'), the
    second through the segment ('auto' on one host): the members' buckets are byte for byte equal."""
    svc, port = weight_sync_service
    named = _named()
    t, out = _start_member(svc, port, "g0", 2)
    with WeightSender("127.0.0.1", port, timeout_s=20, join_timeout_s=10, same_host="broadcast",
                      serve_in_background=False) as s1:
        st1 = s1.publish(1, named)
    with WeightSender("127.0.0.1", port, timeout_s=20, join_timeout_s=10, same_host="auto",
                      serve_in_background=False) as s2:
        st2 = s2.publish(2, named)
    t.join(30)
    assert st1["ok"] == ["g0"] and st2["ok"] == ["g0"], (st1, st2)
    assert st2["shm_s"] > 0 and "shm_s" not in st1
    (v1, via1, b1), (v2, via2, b2) = out["g0"]
    assert (v1, via1, v2, via2) == (1, "broadcast", 2, "shm")
    manifest = bk.plan(bk.specs_of(named)[0], 256 << 20)  # both senders' layout
    got1, got2 = bk.unpack(manifest, b1), bk.unpack(manifest, b2)
    for (name, sent), (_, a), (_, b) in zip(named, got1, got2, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name  # bit for bit, whatever the dtype
        assert torch.equal(b, sent), name


def test_after_a_same_host_round_the_gather_writes_into_the_slot(weight_sync_service):
    """Once a round had a member on this host, the sender gathers each version straight into the
    slot (no write of its own per round): the member gets every version bit for bit, and a
    gather that fails half-way leaves a slot no member takes for a version."""
    svc, port = weight_sync_service
    named = _named()
    t, out = _start_member(svc, port, "g0", 3)
    versions = {v: [(n, x + v) for n, x in named] for v in (1, 2, 3)}
    with WeightSender("127.0.0.1", port, timeout_s=20, join_timeout_s=10, same_host="auto",
                      serve_in_background=False) as s:
        stats = [s.publish(1, versions[1])]
        seg = s._segment
        assert seg.direct  # reserved for the gather after its first same-host round

        def broken():  # the learner fails half-way through version 4's gather
            yield from named[:2]
            raise RuntimeError("gather failed")

        with pytest.raises(RuntimeError, match="gather failed"):
            s.publish(4, broken())
        words = seg._mem[:shm.HEADER].view(torch.int64)
        assert int(words[shm._VERSION]) == -1 and int(words[shm._SEQ]) % 2 == 0  # slot 0: no version
        stats += [s.publish(v, versions[v]) for v in (2, 3)]
    t.join(30)
    assert [st["ok"] for st in stats] == [["g0"]] * 3, stats
    assert stats[0]["shm_s"] > 0 and stats[1]["shm_s"] == stats[2]["shm_s"] == 0.0  # gathered into the slot
    manifest = bk.plan(bk.specs_of(named)[0], 256 << 20)
    for v, via, bufs in out["g0"]:
        assert via == "shm"
        for (name, sent), (_, got) in zip(versions[v], bk.unpack(manifest, bufs), strict=True):
            assert torch.equal(got, sent), (v, name)


def test_a_member_that_never_answers_does_not_stall_the_others(weight_sync_service):
    """'ghost' joins the round and then goes silent (never says ready, never builds the group):
    the round still reaches 'g0' within its timeout, and reports the ghost as failed."""
    svc, port = weight_sync_service
    named = _named()
    ghost = GeneratorSyncClient("127.0.0.1", port, "ghost")
    ghost.register("transformers")
    t, out = _start_member(svc, port, "g0", 1)

    def silent():
        info = None
        while info is None:
            info = ghost.poll()
            time.sleep(0.01)
        RoundStore(info.host, info.port, info.round_id, 5, info.secret).join(info.rank)  # ... and nothing more

    threading.Thread(target=silent, daemon=True).start()
    timeout_s = 8.0
    with WeightSender("127.0.0.1", port, timeout_s=timeout_s, join_timeout_s=5, setup_timeout_s=1.0,
                      same_host="broadcast", serve_in_background=False) as sender:
        t0 = time.monotonic()
        stats = sender.publish(1, named)
        took = time.monotonic() - t0
    t.join(20)
    assert stats["ok"] == ["g0"] and stats["failed"] == ["ghost"], stats
    assert took < timeout_s and stats["attempts"] == 2
    assert out["g0"][0][:2] == (1, "broadcast")
    manifest = bk.plan(bk.specs_of(named)[0], 256 << 20)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bk.unpack(manifest, out["g0"][0][2]), named))
    ghost.close()


_JOIN_AND_DIE = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[2])
from weight_sync.client import GeneratorSyncClient
from weight_sync.round import RoundStore
ws = GeneratorSyncClient("127.0.0.1", int(sys.argv[1]), "doomed")
ws.register("transformers")
info = None
while info is None:
    info = ws.poll()
    time.sleep(0.01)
RoundStore(info.host, info.port, info.round_id, 5, info.secret).join(info.rank, shm=True)
time.sleep(0.3)
os.kill(os.getpid(), signal.SIGKILL)  # joined the same-host read, then gone before its report
"""


def test_a_same_host_member_killed_mid_round_fails_at_once_not_at_the_deadline(weight_sync_service):
    """A same-host member has no group whose failure would tell the sender it died: it names its
    process when it joins, and the sender counts it failed once that process is gone (here left a
    zombie, unreaped), not at the round's deadline. The other member is served, and the round's
    `same_host` counts only members the slot served."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    svc, port = weight_sync_service
    named = _named()
    doomed = subprocess.Popen([sys.executable, "-c", _JOIN_AND_DIE, str(port), str(Path(__file__).parents[2])])
    try:
        deadline = time.monotonic() + 60
        while "doomed" not in svc.state.generators and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "doomed" in svc.state.generators, "the doomed member never registered"
        t, out = _start_member(svc, port, "g0", 1)
        timeout_s = 30.0
        with WeightSender("127.0.0.1", port, timeout_s=timeout_s, join_timeout_s=10, same_host="auto",
                          serve_in_background=False) as sender:
            t0 = time.monotonic()
            stats = sender.publish(1, named)
            took = time.monotonic() - t0
        t.join(20)
        assert doomed.wait(5) == -signal.SIGKILL  # it did die mid-round
    finally:
        doomed.kill()
        doomed.wait()
    assert stats["ok"] == ["g0"] and stats["failed"] == ["doomed"], stats
    assert stats["same_host"] == 1, stats
    assert took < 10, f"the round waited {took:.1f}s for a member that was gone (timeout {timeout_s}s)"
    assert out["g0"][0][:2] == (1, "shm")


def test_groups_of_k_serve_every_member_and_a_silent_one_costs_only_its_group(weight_sync_service):
    """group_size 2, three members and a ghost (joins, then silent): two groups one after the other,
    the ghost's group built again without it; every live member gets the version bit for bit."""
    svc, port = weight_sync_service
    named = _named()
    out: dict = {}
    threads = [threading.Thread(target=_member, args=(port, f"g{i}", out)) for i in range(3)]
    for t in threads:
        t.start()
    while not all(f"g{i}" in svc.state.generators for i in range(3)):
        time.sleep(0.01)
    ghost = GeneratorSyncClient("127.0.0.1", port, "ghost")
    ghost.register("transformers")

    def silent():
        info = None
        while info is None:
            info = ghost.poll()
            time.sleep(0.01)
        RoundStore(info.host, info.port, info.round_id, 5, info.secret).join(info.rank)

    threading.Thread(target=silent, daemon=True).start()
    timeout_s = 10.0
    with WeightSender("127.0.0.1", port, timeout_s=timeout_s, join_timeout_s=5, setup_timeout_s=1.0, group_size=2,
                      same_host="broadcast", serve_in_background=False) as sender:
        t0 = time.monotonic()
        stats = sender.publish(1, named)
        took = time.monotonic() - t0
    for t in threads:
        t.join(20)
    assert stats["ok"] == ["g0", "g1", "g2"] and stats["failed"] == ["ghost"], stats
    assert took < timeout_s and stats["attempts"] == 3  # two groups, the ghost's built twice
    manifest = bk.plan(bk.specs_of(named)[0], 256 << 20)
    for i in range(3):
        (version, via, got), = out[f"g{i}"]
        assert (version, via) == (1, "broadcast")
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bk.unpack(manifest, got), named))
    ghost.close()


def _in_place_member(port: int, out: dict, loads: list) -> None:
    """A member that loads each round straight out of the slot into `out["weights"]` (a model's
    tensors); `loads[i]` is called after round i's copy, before the seqlock's second look (None:
    nothing), to rewrite the slot under it as a sender that lapped a stalled member does."""
    from weight_sync.slot import WeightsDamaged, in_place, load_in_place

    ws = GeneratorSyncClient("127.0.0.1", port, "g0")
    ws.register("transformers")
    deadline = time.monotonic() + 30
    while len(out["stats"]) < len(loads) and time.monotonic() < deadline:
        info = ws.poll()
        if info is None:
            time.sleep(0.01)
            continue
        assert in_place(info)
        after = loads[len(out["stats"])]

        def load(named):
            out["weights"] = {n: t.clone() for n, t in named}
            if after is not None:
                after()

        try:
            out["stats"].append(load_in_place(info, load))
            out["loaded"].append(dict(out["weights"]))
        except (WeightsDamaged, RuntimeError) as e:
            out["stats"].append(e)
        ws.done(info.version)
    ws.close()


def test_an_in_place_load_reads_the_slot_itself_and_repairs_a_torn_one(weight_sync_service):
    """A member on the sender's host loads straight out of the slot (no receive buffers): bit for
    bit the version sent. A slot rewritten under the load (the sender lapped a stalled member) is
    loaded again from the newest complete version, which the stats name; one rewritten under every
    try ends in `WeightsDamaged`, and the round counts the member failed, as it does at once when
    the engine's load raises."""
    from weight_sync.slot import REPAIRS, WeightsDamaged

    svc, port = weight_sync_service
    named = _named()
    versions = {v: [(n, x + v) for n, x in named] for v in range(1, 20)}
    box: dict = {"left": 0}

    def rewrite():  # the sender writes a newer version into the slot being loaded (same parity)
        if box["left"] > 0:
            box["left"] -= 1
            v, box["next"] = box["next"], box["next"] + 2
            box["seg"].write(v, *bk.gather(versions[v], 256 << 20))

    def broken():
        raise RuntimeError("the engine refused the weights")

    out: dict = {"stats": [], "loaded": []}
    t = threading.Thread(target=_in_place_member, args=(port, out, [None, rewrite, rewrite, broken]))
    t.start()
    while "g0" not in svc.state.generators:
        time.sleep(0.01)
    with WeightSender("127.0.0.1", port, timeout_s=20, join_timeout_s=10, same_host="auto",
                      serve_in_background=False) as s:
        stats = [s.publish(1, versions[1])]
        box.update(seg=s._segment, left=1, next=4)  # v2's slot 0 gets v4 once
        stats.append(s.publish(2, versions[2]))
        box.update(left=REPAIRS + 1, next=5)  # v3's slot 1 gets v5, v7, ... under every load
        stats.append(s.publish(3, versions[3]))
        g0, until = svc.state.generators["g0"], time.monotonic() + 10
        while (g0.dead or g0.absent) and time.monotonic() < until:  # failed: in rounds again once heard from
            time.sleep(0.01)
        t0 = time.monotonic()
        stats.append(s.publish(4, versions[4]))  # a load that fails is reported at once, not at the deadline
        failed_s = time.monotonic() - t0
    t.join(30)
    assert [st["ok"] for st in stats] == [["g0"], ["g0"], [], []], stats
    assert failed_s < 5, failed_s
    first, repaired, damaged, refused = out["stats"]
    assert isinstance(refused, RuntimeError) and "refused" in str(refused), refused
    assert (first["version"], first["repairs"], first["via"]) == (1, 0, "shm_in_place")
    assert (repaired["version"], repaired["repairs"]) == (4, 1)  # v2 torn by v4: v4 loaded again
    assert isinstance(damaged, WeightsDamaged) and box["left"] == 0, damaged
    for v, loaded in zip((1, 4), out["loaded"]):
        for name, sent in versions[v]:
            assert torch.equal(loaded[name], sent), (v, name)
