"""The receiving end of a round: join the round's group, take the buckets, hand back named views.

Used inside a generator's engine: vLLM's worker (`actors.engines.vllm.worker.WorkerExtension`) and the
plain transformers backend (`receive_into_model`). A member's steps (the keys and the attempts
are in `weight_sync/round.py`):

1. say `join/<rank>` (as `shm` when the round's shared-memory segment is on this host and this
   process can open it, or map its CUDA slot: then it copies the version from there,
   `slot.read_slot`, and skips 2-4; a CUDA member also names its device, `slot.identity`), and
   take the receive buffers (reused between rounds when the layout matches);
2. wait for attempt k's roster; left out (or `abort`): `RoundMissed`, nothing loaded
   (`RoundRefused` when the sender said why: a member on the sender's own GPU that no slot can
   serve, `shm.route`); say `ready` and wait for the sender's `go` (or attempt k+1's roster, when
   another member never answered);
3. build attempt k's group and receive every bucket (`buckets.sent`) from group rank 0 into its
   own buckets;
4. report `ok` and return the buckets; on a failed broadcast report `err` and wait for attempt k+1.

A same-host member (a vLLM worker) takes no buffers at all: `slot.load_in_place` hands its load
views of the sender's slot (its host slot, or for a CUDA member its device slot mapped by CUDA
IPC), then checks the slot's seqlock.

A member receiving the broadcast onto a device (a CUDA vLLM worker) does not hold the model in
buffers either: `receive_streaming` receives through two areas of the largest bucket and loads
each bucket into the engine before its area is reused (docs/weight_sync_memory.md has the
figures). The price: until the last bucket is loaded the engine holds a mixture, so a round that
does not complete leaves it `WeightsDamaged` rather than unchanged.

A round whose `info.adapter` is set carries a LoRA adapter (peft's tensor names): vLLM loads it
as an adapter (`adapter.write_adapter`); a plain torch model gets it merged into its weights by
`receive_into_model` (`adapter.merge_adapter`).
"""

from __future__ import annotations

import os
import time
from typing import Any

from weight_sync import buckets as bk
from weight_sync import shm
from weight_sync.adapter import merge_adapter
from weight_sync.groups import AbortAt, Bounded, failed_group, member_groups
from weight_sync.messages import RoundInfo, round_info
from weight_sync.round import RoundMissed, RoundStore, member_store
from weight_sync.slot import WeightsDamaged, identity, read_slot

__all__ = ["RoundMissed", "RoundRefused", "receive_buckets", "receive_streaming", "receive_named_tensors",
           "receive_into_model", "load_disk"]


def receive_buckets(info: RoundInfo, local_rank: int = 0, device: Any = "cpu",
                    buffers: list | None = None) -> tuple[list, dict]:
    """Join the round as rank `info.rank + local_rank` and receive every bucket.

    Returns (buckets, stats). Raises `RoundMissed` when this rank is left out or the round gives up
    on it; nothing is loaded in that case. `buffers`: a list this caller keeps between rounds; the
    buckets are received into it when the layout matches (fresh host memory costs a page fault per
    4 KiB on first touch, as much as the transfer itself on CPU), and it is refilled otherwise.
    The buckets are the whole model: on a device, receive with `receive_streaming` instead.
    """
    import torch

    t0 = time.monotonic()
    deadline = t0 + info.timeout_s
    rank = info.rank + local_rank
    rs = member_store(info, rank, deadline)
    via_shm = info.shm is not None and shm.usable(info.shm, device)
    rs.join(rank, shm=via_shm, **identity(info, device))
    sizes = list(info.manifest.buckets)
    if buffers is not None and [b.numel() for b in buffers] == sizes and all(_on(b, device) for b in buffers):
        bufs = list(buffers)
    else:
        bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        if buffers is not None:
            buffers[:] = bufs
    if via_shm:
        return read_slot(info, rs, rank, bufs, deadline, t0)

    def transfer(pg) -> None:
        # every bucket's collective issued at once, in the sender's order (buckets.sent)
        works = [pg.broadcast(view, 0) for view in bk.targets(info.manifest, bufs)]
        for work in works:
            work.wait()
        bk.sync_device(device)

    recv_s, attempts = _attempts(info, rs, rank, deadline, transfer)
    stats = {"recv_s": recv_s, "join_to_done_s": time.monotonic() - t0, "attempts": attempts, "via": "broadcast",
             "bytes": info.manifest.total_bytes, "buckets": len(bufs)}
    return bufs, stats


def _attempts(info: RoundInfo, rs: RoundStore, rank: int, deadline: float, transfer) -> tuple[float, int]:
    """Steps 2-4 of a broadcast member (the module's docstring): attempt after attempt until
    `transfer(pg)` has run its collectives through one attempt's group and this rank said `ok`.
    Returns (seconds in the successful transfer, attempts). Raises `RoundMissed` (`RoundRefused`
    when the sender said why) when this rank is left out, or the round ends without it. A
    `transfer` that raises `Stop` is reported `err` and not retried: the `Stop` goes up."""
    attempt = 0
    while True:
        roster = rs.wait_roster(attempt, deadline)
        if roster is None:
            raise RoundMissed(f"rank {rank}: no roster for attempt {attempt} of round {info.round_id} "
                              f"within {info.timeout_s}s")
        if not roster.abort and rank in roster.later:  # a later group's: wait for its attempt
            attempt += 1
            continue
        if roster.abort or rank not in roster.ranks:
            why = rs.refusal(rank)
            if why is not None:
                raise RoundRefused(why)
            raise RoundMissed(f"rank {rank}: left out of round {info.round_id} (attempt {attempt})")
        pg, failure, stop = None, None, False
        group_rank, where = 1 + roster.ranks.index(rank), (info.host, info.port)
        try:
            # the group kept from an earlier round, if the roster offers it and this rank holds it
            held = member_groups.holds(where, info.secret, roster.group, group_rank)
            rs.set_ready(attempt, rank, holds=roster.group if held is not None else "")
            go = rs.wait_go(attempt, deadline)
            if go is None:  # someone never answered: the next attempt goes on without it
                attempt += 1
                continue
            if go.reuse:
                pg = held
                if pg is None:
                    raise RuntimeError(f"told to reuse group {go.group}, which rank {rank} does not hold")
            else:
                pg = rs.group(info.backend, attempt, group_rank, 1 + len(roster.ranks), deadline, info.timeout_s)
                member_groups.keep(where, info.secret, go.group, group_rank, pg)
            held = None
            t_bcast = time.monotonic()
            with AbortAt(pg, deadline):  # every wait in it ends by the deadline (groups.py: `Bounded`)
                transfer(Bounded(pg, deadline))
            recv_s = time.monotonic() - t_bcast
            rs.report(attempt, rank, ok=True)
        except Stop as e:  # nothing to retry: say so, and stop
            failure, stop = e, True
        except Exception as e:
            failure = e
        if failure is not None:
            # a member (maybe the sender) died: say so, drop the group, wait for the next attempt.
            # The group goes now, with the collectives still queued on it (they hold it: the
            # failure's traceback holds `transfer`'s frame): members that receive
            # through this one are then told at once, not when the next attempt rebinds these
            # names (after the sender's grace period, too late to be served again)
            failure.__traceback__ = None
            member_groups.forget(where, group_rank)
            failed_group(pg, failure)
            pg = held = None
            try:
                rs.report(attempt, rank, ok=False)
            except Exception:
                if not stop:
                    raise RoundMissed(f"rank {rank}: broadcast failed ({failure}) and the sender is gone") from None
            if stop:
                raise failure
            failure = None
            attempt += 1
            continue
        del pg  # kept for the next round (`member_groups`): its members may be the same
        return recv_s, attempt + 1


class Stop(Exception):
    """Raised by a `transfer` of `_attempts` whose failure a retry would not mend (the engine
    refused the weights): the sender is told `err` and this member leaves the round."""


AREAS = 2  # receive areas of a streamed round: bucket k+1 arrives while bucket k is loaded


def _alloc(nbytes: int, device: Any):
    """A receive area: every byte of device memory `receive_streaming` takes comes from here (the
    memory test counts what it hands out)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _on(t, device: Any) -> bool:
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return t.device == device


def receive_areas(info: RoundInfo, device: Any = "cpu", kept: list | None = None, count: int = AREAS) -> list:
    """`count` receive areas of the round's largest bucket on `device`: `kept` (the caller's list,
    kept between rounds) when they are large enough, else new ones, which replace it (the old ones
    are let go first: the two never coexist)."""
    size = max(info.manifest.buckets, default=0)
    if kept is not None and len(kept) == count and all(a.numel() >= size and _on(a, device) for a in kept):
        return list(kept)
    if kept is not None:
        kept.clear()
    areas = [_alloc(size, device) for _ in range(count)]
    if kept is not None:
        kept[:] = areas
    return areas


def bucket_views(manifest, bucket: int, area) -> list[tuple[str, Any]]:
    """(name, tensor) views of bucket `bucket`'s tensors as they lie in `area`."""
    return [(t.name, bk.tensor_view(t, area)) for t in manifest.tensors if t.bucket == bucket]


def receive_streaming(info: RoundInfo, load, local_rank: int = 0, device: Any = "cpu",
                      areas: list | None = None, count: int = AREAS, stages: bool = False) -> dict:
    """Join the round as rank `info.rank + local_rank` and hand each bucket to `load` as it arrives.

    The round is received through `count` areas of the largest bucket (`receive_areas`; `areas`
    is the caller's list, kept between rounds), not into buffers for the whole model: bucket j
    lands in area j % count, `load(named)` takes its (name, view) pairs (copying them into the
    engine), and only then is bucket j + count received into the same area. So the member's extra
    memory is `count` x the largest bucket, whatever the model's size (tests/weight_sync/test_memory.py
    counts it). With the default two areas, bucket j + 1 arrives while bucket j is loaded.

    Order on a CUDA device: `work.wait()` of an NCCL broadcast returns once the output can be used
    on the current stream without further synchronisation (torch's docs/source/distributed.rst,
    "Synchronous and asynchronous collective operations"), so the load's copies, queued on the
    current stream, read the whole bucket. Before bucket j + count is posted into bucket j's area
    the host waits for the current stream (`buckets.sync_device`): the load has read the area by then,
    whatever stream NCCL writes from. Bucket j + 1 was posted before, so it still arrives while
    bucket j is loaded. On the CPU (gloo) every step is in order anyway.

    Loaded bucket by bucket, the engine holds a mixture of versions from the first bucket until
    the last: only a round that arrived completely, and was loaded completely, is reported `ok`.
    A failed broadcast is retried by the sender's next attempt, which sends (and this loads)
    every bucket again. If the round ends without a complete load (left out of the retry, sender
    gone, deadline, or `load` raised), and anything was loaded, `WeightsDamaged` ("weights
    damaged: ..."): the engine must not serve these weights (the generator stops, and its next
    start takes the current version before its first lease: actors/weight_hook.py). If nothing
    was loaded, `RoundMissed` as for `receive_buckets`, the weights unchanged. `stages`: `load`
    only copies the bytes aside (the engine is loaded after the round), so a broken round is
    `RoundMissed` whatever was copied.

    Returns the round's stats (`via`: "stream", `areas`, `area_bytes`)."""
    if count < 1:
        raise ValueError(f"receive_streaming: count={count} areas; at least 1")
    t0 = time.monotonic()
    deadline = t0 + info.timeout_s
    rank = info.rank + local_rank
    rs = member_store(info, rank, deadline)
    rs.join(rank, **identity(info, device))
    manifest = info.manifest
    order = bk.sent(manifest)
    bufs = receive_areas(info, device, areas, count)
    state = {"loaded": False}  # whether `load` was ever called: the engine's weights may be a mixture

    def transfer(pg) -> None:
        refused = None  # the engine's error: the remaining buckets are received (the others' round
        # goes on) but not loaded
        works = {}

        def post(j: int) -> None:
            works[j] = pg.broadcast(bufs[j % count][:manifest.buckets[order[j]]], 0)

        for j in range(min(count, len(order))):
            post(j)
        for j, b in enumerate(order):
            works.pop(j).wait()
            if refused is None:
                try:
                    if not stages:
                        state["loaded"] = True
                    load(bucket_views(manifest, b, bufs[j % count]))
                except Exception as e:
                    refused = e
            if j + count < len(order):
                bk.sync_device(device)  # bucket j's load has read its area before it is written again
                post(j + count)
        if refused is None and len(order) < len(manifest.buckets):  # zero-size tensors of empty buckets
            try:
                load([v for b in range(len(manifest.buckets)) if b not in order
                      for v in bucket_views(manifest, b, bufs[0])])
            except Exception as e:
                refused = e
        bk.sync_device(device)
        if refused is not None:
            raise Stop(f"{type(refused).__name__}: {refused}") from refused

    try:
        recv_s, attempts = _attempts(info, rs, rank, deadline, transfer)
    except Stop as e:
        if stages:
            raise RoundMissed(f"rank {rank}: {e}") from e.__cause__
        raise WeightsDamaged(f"weights damaged: the engine refused part of v{info.version} while it loaded it "
                             f"bucket by bucket ({e})") from e.__cause__
    except RoundMissed as e:
        if state["loaded"]:
            raise WeightsDamaged(f"weights damaged: v{info.version} was loaded bucket by bucket and the round "
                                 f"ended before every bucket arrived ({e})") from e
        raise
    return {"recv_s": recv_s, "join_to_done_s": time.monotonic() - t0, "attempts": attempts, "via": "stream",
            "bytes": manifest.total_bytes, "buckets": len(order), "areas": count,
            "area_bytes": max(manifest.buckets, default=0)}


class RoundRefused(RoundMissed):
    """The sender refused this member the round, and said why (a configuration it cannot be
    served in: `weight_sync.shm.route`); the message names the fix."""


# What a round's failure says (as text: it crosses vLLM's collective_rpc) when the generator must
# not go on serving: its weights are a mixture, or no round can ever reach it where it runs
FATAL = ("weights damaged:", "NCCL refuses two ranks on one device")


def fatal(error: str) -> bool:
    """Whether a failed round's message means the generator must stop (`FATAL`)."""
    return any(mark in error for mark in FATAL)

def load_disk(info: RoundInfo, device: Any = "cpu") -> list[tuple[str, Any]]:
    """The named tensors of a disk round (`info.path` holds `model.safetensors` + manifest)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(info.path, "model.safetensors"), device=str(device))
    names = info.manifest.names
    missing = [n for n in names if n not in tensors]
    if missing:
        raise RoundMissed(f"{info.path}: missing tensors {missing[:5]}")
    return [(n, tensors[n]) for n in names]


def receive_named_tensors(info: RoundInfo | dict, local_rank: int = 0, device: Any = "cpu",
                          buffers: list | None = None) -> tuple[list, dict]:
    """(name, tensor) pairs of a round, whatever its backend, and the receive stats.

    With `buffers` (see `receive_buckets`) the tensors are views into those reused buffers: valid
    until the next round received into them. `info` may be a plain map (as `collective_rpc`
    delivers it); it is checked either way.
    """
    info = round_info(info)
    t0 = time.monotonic()
    if info.backend == "disk":
        named = load_disk(info, device)
        return named, {"recv_s": time.monotonic() - t0, "bytes": info.manifest.total_bytes, "buckets": 0,
                       "attempts": 1}
    bufs, stats = receive_buckets(info, local_rank, device, buffers)
    return bk.unpack(info.manifest, bufs), stats

def receive_into_model(model, info: RoundInfo | dict, strict: bool = True, base: dict | None = None) -> dict:
    """Receive a round and copy it into a transformers (or any torch) model's parameters/buffers.

    `strict`: every name in the round must exist in the model. An adapter round is merged into
    the weights: `base` is the caller's dict of original weights, kept between rounds (filled at
    the first). Returns stats with `load_s`.
    """
    import torch

    info = round_info(info)
    device = next(model.parameters()).device
    named, stats = receive_named_tensors(info, 0, "cpu")
    t0 = time.monotonic()
    if info.adapter is not None:
        if base is None:
            raise ValueError(f"round {info.round_id} carries a LoRA adapter: merging it needs the caller's `base` dict")
        loaded = merge_adapter(model, named, info.adapter, base)
        stats.update(load_s=time.monotonic() - t0, version=info.version, loaded=loaded)
        return stats
    if base is not None:
        base.clear()  # full weights replace what adapters were merged into
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    unknown = [n for n, _ in named if n not in targets]
    if unknown and strict:
        raise KeyError(f"round {info.round_id} names tensors the model lacks: {unknown[:5]}")
    with torch.no_grad():
        for name, t in named:
            if name in targets:
                targets[name].copy_(t.to(device))
    stats.update(load_s=time.monotonic() - t0, version=info.version, loaded=len(named) - len(unknown))
    return stats
