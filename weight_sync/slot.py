"""A member on the sender's host: the version straight out of the sender's slot, no broadcast.

`weight_sync/shm.py` is the segment itself (its slots, their seqlock, who may open them); this is
a round's member reading it. The member joins as `shm` (`RoundStore.join`), waits for the
segment's roster (`shm/roster`: the sender has written the version by then) and either copies
the slot into its receive buffers (`read_slot`, the same-host path of `receiver.receive_buckets`)
or, a vLLM worker, takes no buffers at all: `load_in_place` hands its load views of the sender's
slot (its host slot, or for a CUDA member its device slot mapped by CUDA IPC), then checks the
slot's seqlock. Either way it reports on `ashm/done/<rank>`, which the sender reads alongside the
broadcast.

A CUDA member also names its device when it joins, broadcast or not (`identity`): the sender
keeps a member on its own GPU out of the NCCL groups and may move the slot to its device for it.
"""

from __future__ import annotations

import time
from typing import Any

from weight_sync import buckets as bk
from weight_sync import shm
from weight_sync.messages import RoundInfo
from weight_sync.round import RoundMissed, RoundStore, member_store


class WeightsDamaged(RuntimeError):
    """An in-place load was overwritten under it and no complete version could be loaded again
    within the round's bound: the engine's weights are a mixture and it must not serve them."""


REPAIRS = 5  # loads again after a torn in-place read before the weights are given up as damaged


def identity(info: RoundInfo, device: Any) -> dict:
    """What this member tells the sender when it joins (`RoundStore.join`): the UUID of its CUDA
    device, and whether it sees the sender's device (read from the segment's header), so could
    map a slot there by CUDA IPC."""
    if not str(device).startswith("cuda"):
        return {}
    uuid = shm.device_uuid(device)
    ipc = (info.backend == "nccl" and info.shm is not None and info.shm.host == shm.host_id()
           and shm.sender_uuid(info.shm) in shm.visible_uuids())
    return {"device": uuid, "ipc": ipc}


def _wait_roster(info: RoundInfo, rs: RoundStore, rank: int, deadline: float) -> None:
    """Until the sender names the segment's readers; `RoundMissed` if not in time or not this rank."""
    roster = rs.wait_shm_roster(deadline)
    if roster is None:
        raise RoundMissed(f"rank {rank}: no roster for round {info.round_id} (shared memory) within {info.timeout_s}s")
    if rank not in roster.ranks:
        raise RoundMissed(f"rank {rank}: left out of round {info.round_id} (shared memory)")


def read_slot(info: RoundInfo, rs: RoundStore, rank: int, bufs: list, deadline: float, t0: float):
    """The same-host path of `receive_buckets`: wait for the segment's roster, copy, report."""
    _wait_roster(info, rs, rank, deadline)
    t_read = time.monotonic()
    try:
        shm.read(info.shm, info.version, info.manifest, bufs)
    except RoundMissed:
        rs.report("shm", rank, ok=False)
        raise
    recv_s = time.monotonic() - t_read
    rs.report("shm", rank, ok=True)
    return bufs, {"recv_s": recv_s, "join_to_done_s": time.monotonic() - t0, "attempts": 1,
                  "via": "cuda_ipc" if info.shm.ipc else "shm",
                  "bytes": info.manifest.total_bytes, "buckets": len(bufs)}


def in_place(info: RoundInfo, device: Any = "cpu") -> bool:
    """Whether this member loads the round straight out of the sender's slot (`load_in_place`): a
    same-host round of full weights whose slot this member can use (`shm.usable`): the host slot
    (from the CPU, or copied host to device by the load), or for a CUDA member the slot on the
    sender's device, mapped by CUDA IPC. Either way no receive buffer is taken: a CUDA member's
    extra device memory for the round is nil."""
    return info.backend != "disk" and info.adapter is None and info.shm is not None and shm.usable(info.shm, device)


def load_in_place(info: RoundInfo, load, local_rank: int = 0, device: Any = "cpu") -> dict:
    """Join a same-host round (`in_place`) and call `load(named)` on views of the sender's slot
    itself: the engine copies the version once, from the segment into its weights, instead of into
    receive buffers first. `load` returns what completes the load (e.g. repacking layers), called
    once the seqlock confirms the slot was not rewritten meanwhile.

    A slot rewritten under the load (the sender lapped this member: it was stalled past two rounds)
    has left a mixture in the engine: it loads again from the newest complete version in the
    segment (>= the round's), up to `REPAIRS` times within the round's bound, and the stats name
    the version it holds. If none holds still, `WeightsDamaged`. Returns stats with `version`.
    """
    t0 = time.monotonic()
    deadline = t0 + info.timeout_s
    rank = info.rank + local_rank
    rs = member_store(info, rank, deadline)
    rs.join(rank, shm=True, **identity(info, device))
    _wait_roster(info, rs, rank, deadline)
    t_load = time.monotonic()
    try:  # the sender waits for this member's word: it hears it however the load ends
        slot = shm.open_slot(info.shm, info.version, info.manifest)  # nothing loaded if it is not there
        repairs = 0
        while True:
            finish = load(bk.unpack(info.manifest, slot.buckets))
            bk.sync_device(device)  # the copies out of the slot are done before the seqlock's second look
            if shm.intact(info.shm, slot, info.manifest):
                break
            again = None
            while again is None and repairs < REPAIRS and time.monotonic() < deadline:
                again = shm.newest(info.shm, info.manifest, info.version)
                if again is None:
                    time.sleep(0.01)  # the writer is in the middle of the newer version
            if again is None:
                raise WeightsDamaged(f"weights damaged: v{slot.version} was overwritten in shared memory while it "
                                     f"was loaded, and no complete version could be loaded again ({repairs} tries)")
            slot, repairs = again, repairs + 1
        if finish is not None:
            finish()
    except BaseException:
        try:
            rs.report("shm", rank, ok=False)
        except Exception:  # the sender is gone: nobody waits for the word
            pass
        raise
    load_s = time.monotonic() - t_load
    rs.report("shm", rank, ok=True)
    return {"recv_s": 0.0, "load_s": load_s, "join_to_done_s": time.monotonic() - t0, "attempts": 1 + repairs,
            "via": "shm_in_place", "bytes": info.manifest.total_bytes, "buckets": len(slot.buckets),
            "version": slot.version, "repairs": repairs}
