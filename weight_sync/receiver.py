"""The receiving end of a round: join the round's group, take the buckets, hand back named views.

Used inside a generator's engine: vLLM's worker (`actors.vllm_worker.WorkerExtension`) and the
plain transformers backend (`receive_into_model`). A member's steps (the keys and the attempts
are in `weight_sync/round.py`):

1. say `join/<rank>` (as `shm` when the round's shared-memory segment is on this host and this
   process can open it, or map its CUDA slot: then it copies the version from there, `_read_shm`,
   and skips 2-4), and take the receive buffers (reused between rounds when the layout matches);
2. wait for attempt k's roster; left out (or `abort`): `RoundMissed`, nothing loaded; say `ready`
   and wait for the sender's `go` (or attempt k+1's roster, when another member never answered);
3. build attempt k's group and receive every bucket (`buckets.sent`) from group rank 0 into its
   own buckets;
4. report `ok` and return the buckets; on a failed broadcast report `err` and wait for attempt k+1.

A same-host member receiving on the CPU (a vLLM worker) takes no buffers at all: `load_in_place`
hands its load views of the sender's slot, then checks the slot's seqlock.

A round whose `info.adapter` is set carries a LoRA adapter (peft's tensor names): vLLM loads it
as an adapter from the folder `write_adapter` fills (peft's format); a plain torch model gets it
merged into its weights by `receive_into_model` (base + scale * B @ A, from the base weights it
kept at the first adapter round).
"""

from __future__ import annotations

import os
import time
from typing import Any

from weight_sync import buckets as bk
from weight_sync import shm
from weight_sync.messages import Adapter, RoundInfo, round_info
from weight_sync.round import RoundMissed, RoundStore, dispose

__all__ = ["RoundMissed", "receive_buckets", "receive_named_tensors", "receive_into_model", "load_disk",
           "write_adapter", "adapter_modules", "merge_adapter"]

PEFT_PREFIX = "base_model.model."


def _sync_device(device) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def receive_buckets(info: RoundInfo, local_rank: int = 0, device: Any = "cpu",
                    buffers: list | None = None) -> tuple[list, dict]:
    """Join the round as rank `info.rank + local_rank` and receive every bucket.

    Returns (buckets, stats). Raises `RoundMissed` when this rank is left out or the round gives up
    on it; nothing is loaded in that case. `buffers`: a list this caller keeps between rounds; the
    buckets are received into it when the layout matches (fresh host memory costs a page fault per
    4 KiB on first touch, as much as the transfer itself on CPU), and it is refilled otherwise.
    """
    import torch

    t0 = time.monotonic()
    deadline = t0 + info.timeout_s
    rank = info.rank + local_rank
    rs = _store(info, rank, deadline)
    via_shm = info.shm is not None and shm.usable(info.shm, device)
    rs.join(rank, shm=via_shm)
    sizes = list(info.manifest.buckets)
    if buffers is not None and [b.numel() for b in buffers] == sizes and all(
            b.device == torch.device(device) for b in buffers):
        bufs = list(buffers)
    else:
        bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        if buffers is not None:
            buffers[:] = bufs
    if via_shm:
        return _read_shm(info, rs, rank, bufs, deadline, t0)
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
            raise RoundMissed(f"rank {rank}: left out of round {info.round_id} (attempt {attempt})")
        pg = works = work = None
        try:
            rs.set_ready(attempt, rank)
            if not rs.wait_go(attempt, deadline):  # someone never answered: the next attempt goes on without it
                attempt += 1
                continue
            pg = rs.group(info.backend, attempt, 1 + roster.ranks.index(rank), 1 + len(roster.ranks), deadline)
            t_bcast = time.monotonic()
            # every bucket's collective issued at once, in the sender's order (buckets.sent)
            works = [pg.broadcast(view, 0) for view in bk.targets(info.manifest, bufs)]
            for work in works:
                work.wait()
            del works
            _sync_device(device)
            recv_s = time.monotonic() - t_bcast
            rs.report(attempt, rank, ok=True)
        except Exception as e:
            # a member (maybe the sender) died: say so, drop the group, wait for the next attempt.
            # The group goes now, with the collectives still queued on it (they hold it): members
            # that receive through this one are then told at once, not when the next attempt
            # rebinds these names (after the sender's grace period, too late to be served again)
            works = work = pg = None
            try:
                rs.report(attempt, rank, ok=False)
            except Exception:
                raise RoundMissed(f"rank {rank}: broadcast failed ({e}) and the sender is gone") from None
            attempt += 1
            continue
        dispose(pg)
        del pg
        stats = {"recv_s": recv_s, "join_to_done_s": time.monotonic() - t0, "attempts": attempt + 1, "via": "broadcast",
                 "bytes": info.manifest.total_bytes, "buckets": len(bufs)}
        return bufs, stats


def _store(info: RoundInfo, rank: int, deadline: float) -> RoundStore:
    try:
        return RoundStore(info.host, info.port, info.round_id, deadline - time.monotonic(), info.secret)
    except Exception as e:  # sender gone
        raise RoundMissed(f"rank {rank}: cannot reach the rendezvous store {info.host}:{info.port}: {e}") from None


def _wait_shm_roster(info: RoundInfo, rs: RoundStore, rank: int, deadline: float) -> None:
    """Until the sender names the segment's readers; `RoundMissed` if not in time or not this rank."""
    roster = rs.wait_shm_roster(deadline)
    if roster is None:
        raise RoundMissed(f"rank {rank}: no roster for round {info.round_id} (shared memory) within {info.timeout_s}s")
    if rank not in roster.ranks:
        raise RoundMissed(f"rank {rank}: left out of round {info.round_id} (shared memory)")


def _read_shm(info: RoundInfo, rs: RoundStore, rank: int, bufs: list, deadline: float, t0: float):
    """The same-host path of `receive_buckets`: wait for the segment's roster, copy, report."""
    _wait_shm_roster(info, rs, rank, deadline)
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


class WeightsDamaged(RuntimeError):
    """An in-place load was overwritten under it and no complete version could be loaded again
    within the round's bound: the engine's weights are a mixture and it must not serve them."""


REPAIRS = 5  # loads again after a torn in-place read before the weights are given up as damaged


def in_place(info: RoundInfo, device: Any = "cpu") -> bool:
    """Whether this member loads the round straight out of the sender's host slot (`load_in_place`):
    a same-host round whose slot is in shared memory (not a CUDA IPC slot), received on the CPU."""
    return (info.backend != "disk" and info.adapter is None and str(device) == "cpu" and info.shm is not None
            and not info.shm.ipc and shm.usable(info.shm, device))


def load_in_place(info: RoundInfo, load, local_rank: int = 0) -> dict:
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
    rs = _store(info, rank, deadline)
    rs.join(rank, shm=True)
    _wait_shm_roster(info, rs, rank, deadline)
    t_load = time.monotonic()
    try:  # the sender waits for this member's word: it hears it however the load ends
        slot = shm.open_slot(info.shm, info.version, info.manifest)  # nothing loaded if it is not there
        repairs = 0
        while True:
            finish = load(bk.unpack(info.manifest, slot.buckets))
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


def write_adapter(named: list, adapter: Adapter, folder: str) -> str:
    """An adapter round's tensors as peft's format in `folder` (adapter_config.json and
    adapter_model.safetensors, each written whole, then renamed into place); returns `folder`."""
    import json

    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.r, "lora_alpha": adapter.lora_alpha,
              "target_modules": list(adapter.target_modules), "bias": "none", "lora_dropout": 0.0}
    tmp = os.path.join(folder, f"adapter_model.safetensors.tmp{os.getpid()}")
    # clone: safetensors refuses tensors that share storage (the views share their bucket)
    save_file({n: t.clone() for n, t in named}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, "adapter_model.safetensors"))
    with open(tmp, "w") as f:
        json.dump(config, f)
    os.replace(tmp, os.path.join(folder, "adapter_config.json"))
    return folder


def adapter_modules(named: list) -> dict[str, dict[str, Any]]:
    """An adapter round's tensors by module: `{"model.layers.0.mlp.up_proj": {"A": (r, in), "B": (out, r)}}`."""
    out: dict[str, dict[str, Any]] = {}
    for name, t in named:
        module, sep, part = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise KeyError(f"adapter tensor {name!r} is not a LoRA A or B weight")
        out.setdefault(module, {})[part[0]] = t
    return out


def merge_adapter(model, named: list, adapter: Adapter, base: dict) -> int:
    """Set every adapted weight of `model` to base + scale * B @ A; `base` (the caller's, kept
    between rounds) gets the original weights at the first call. Returns the weights set."""
    import torch

    modules = dict(model.named_modules())
    adapted = adapter_modules(named)
    with torch.no_grad():
        for name, ab in adapted.items():
            if name not in modules or set(ab) != {"A", "B"}:
                raise KeyError(f"adapter module {name!r}: not in the model, or without both A and B")
            weight = modules[name].weight
            w0 = base.setdefault(name, weight.detach().clone())
            delta = ab["B"].to(weight.device, torch.float32) @ ab["A"].to(weight.device, torch.float32)  # (out, in)
            weight.copy_((w0.float() + adapter.scale * delta).to(weight.dtype))
    return len(adapted)


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
