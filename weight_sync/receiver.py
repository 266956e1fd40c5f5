"""The receiving end of a round: join the round's group, take the buckets, hand back named views.

Used inside a generator's engine: vLLM's worker (`actors.vllm_worker.WorkerExtension`) and the
plain transformers backend (`receive_into_model`).

The data plane of one round, on the sender's rendezvous store (a `TCPStore` that lives as long as
the sender; every key below sits under `ws/r<round_id>/`):

    member rank r       join/<r> = 1                      "I am here" (the sender waits join_timeout_s)
    sender              a<k>/roster = {ranks, abort}      attempt k's members, in group-rank order
    everyone in roster  a<k>/pg/...                       a fresh ProcessGroupGloo / NCCL per attempt
    sender              broadcast bucket 0, 1, ... from group rank 0
    member rank r       a<k>/done/<r> = ok | err

A member that dies mid-broadcast makes the others' broadcast fail (gloo reports "connection reset"
within milliseconds, and each side tearing its group down spreads the error); those report `err`,
the sender drops whoever did not report and starts attempt k+1 with the `err` reporters, all within
the round's timeout. A member left out of a roster raises `RoundMissed`; it catches up later.

Store keys are polled with `check` rather than waited on with `wait`: a `wait` that times out
leaves the store client out of step with the server (every later call then fails).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import msgpack

from weight_sync import buckets as bk
from weight_sync.messages import validate_round_info


class RoundMissed(RuntimeError):
    """This generator did not get the round's weights (left out, sender gone, or timed out).

    Its weights are unchanged (nothing is loaded until every bucket arrived): do not report `done`;
    the next poll brings a catch-up round.
    """


# --------------------------------------------------------------------------------------------
# the group: shared with the sender


def round_prefix(round_id: int) -> str:
    return f"ws/r{round_id}"


def open_store(host: str, port: int, timeout_s: float, is_master: bool = False):
    """A TCPStore client (or, with `is_master`, the server on `port`, 0 = any free port)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, is_master, timeout=timedelta(seconds=max(timeout_s, 0.1)),
                         wait_for_workers=False)


def make_group(backend: str, store, rank: int, world_size: int, timeout_s: float):
    """A standalone process group on `store` (separate from any default group: DeepSpeed's stays
    untouched). Every rank must construct it concurrently."""
    import torch.distributed as dist

    timeout = timedelta(seconds=max(timeout_s, 0.1))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"no process group for backend {backend!r}")


def dispose(pg) -> None:
    """Drop a finished group from a short-lived thread: gloo's teardown takes ~20 ms (it joins its
    worker threads), and nobody should wait for it. (Thread.run deletes its args in the thread.)"""
    if pg is not None:
        threading.Thread(target=lambda _pg: None, args=(pg,), name="weight-sync-pg-teardown", daemon=True).start()


def wait_key(store, key: str, deadline: float, poll_s: float = 0.005) -> bool:
    """Poll until `key` exists (True) or `deadline` (monotonic) passes (False)."""
    while True:
        if store.check([key]):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, 0.005)


def pack_roster(ranks: list[int], abort: bool = False) -> bytes:
    return msgpack.packb({"ranks": list(ranks), "abort": abort})


def unpack_roster(raw: bytes) -> dict:
    r = msgpack.unpackb(raw, raw=False)
    if not (isinstance(r, dict) and isinstance(r.get("ranks"), list)):
        raise RoundMissed(f"malformed roster {r!r}")
    return r


def _sync_device(device) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------
# receiving


def receive_buckets(info: dict, local_rank: int = 0, device: Any = "cpu",
                    buffers: list | None = None) -> tuple[list, dict]:
    """Join the round as rank `info["rank"] + local_rank` and receive every bucket.

    Returns (buckets, stats). Raises `RoundMissed` when this rank is left out or the round gives up
    on it; nothing is loaded in that case. `buffers`: a list this caller keeps between rounds; the
    buckets are received into it when the layout matches (fresh host memory costs a page fault per
    4 KiB on first touch, as much as the transfer itself on CPU), and it is refilled otherwise.
    """
    import torch

    t0 = time.monotonic()
    deadline = t0 + float(info["timeout_s"])
    rank = int(info["rank"]) + local_rank
    backend = info["backend"]
    manifest = info["manifest"]
    try:
        store = open_store(info["host"], int(info["port"]), deadline - time.monotonic())
    except Exception as e:  # sender gone
        raise RoundMissed(f"rank {rank}: cannot reach the rendezvous store "
                          f"{info['host']}:{info['port']}: {e}") from None
    from torch.distributed import PrefixStore

    ps = PrefixStore(round_prefix(int(info["round_id"])), store)
    ps.set(f"join/{rank}", b"1")
    sizes = list(manifest["buckets"])
    if buffers is not None and [b.numel() for b in buffers] == sizes and all(
            b.device == torch.device(device) for b in buffers):
        bufs = list(buffers)
    else:
        bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        if buffers is not None:
            buffers[:] = bufs
    attempt = 0
    while True:
        key = f"a{attempt}/roster"
        if not wait_key(ps, key, deadline):
            raise RoundMissed(f"rank {rank}: no roster for attempt {attempt} of round {info['round_id']} "
                              f"within {info['timeout_s']}s")
        roster = unpack_roster(ps.get(key))
        if roster.get("abort") or rank not in roster["ranks"]:
            raise RoundMissed(f"rank {rank}: left out of round {info['round_id']} (attempt {attempt})")
        group_rank = 1 + roster["ranks"].index(rank)
        world = 1 + len(roster["ranks"])
        pg = None
        try:
            # the group gets a store client of its own: if its rendezvous times out, that client
            # is left unusable, and the control keys must still get through on `ps`
            pg_store = open_store(info["host"], int(info["port"]), deadline - time.monotonic())
            pg = make_group(backend, PrefixStore(f"{round_prefix(int(info['round_id']))}/a{attempt}/pg", pg_store),
                            group_rank, world, deadline - time.monotonic())
            t_bcast = time.monotonic()
            for b in bufs:
                if b.numel():
                    pg.broadcast(b, 0).wait()
            _sync_device(device)
            recv_s = time.monotonic() - t_bcast
            ps.set(f"a{attempt}/done/{rank}", b"ok")
        except Exception as e:
            # a member (maybe the sender) died: say so, drop the group, wait for the next attempt
            del pg
            try:
                ps.set(f"a{attempt}/done/{rank}", b"err")
            except Exception:
                raise RoundMissed(f"rank {rank}: broadcast failed ({e}) and the sender is gone") from None
            attempt += 1
            continue
        dispose(pg)
        del pg
        stats = {"recv_s": recv_s, "join_to_done_s": time.monotonic() - t0, "attempts": attempt + 1,
                 "bytes": bk.total_bytes(manifest), "buckets": len(bufs)}
        return bufs, stats


def load_disk(info: dict, device: Any = "cpu") -> list[tuple[str, Any]]:
    """The named tensors of a disk round (`info["path"]` holds `model.safetensors` + manifest)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(info["path"], "model.safetensors"), device=str(device))
    names = [t[0] for t in info["manifest"]["tensors"]]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise RoundMissed(f"{info['path']}: missing tensors {missing[:5]}")
    return [(n, tensors[n]) for n in names]


def receive_named_tensors(info: dict, local_rank: int = 0, device: Any = "cpu",
                          buffers: list | None = None) -> tuple[list, dict]:
    """(name, tensor) pairs of a round, whatever its backend, and the receive stats.

    With `buffers` (see `receive_buckets`) the tensors are views into those reused buffers: valid
    until the next round received into them.
    """
    validate_round_info(info)
    t0 = time.monotonic()
    if info["backend"] == "disk":
        named = load_disk(info, device)
        return named, {"recv_s": time.monotonic() - t0, "bytes": bk.total_bytes(info["manifest"]),
                       "buckets": 0, "attempts": 1}
    bufs, stats = receive_buckets(info, local_rank, device, buffers)
    return bk.unpack(info["manifest"], bufs), stats


def receive_into_model(model, round_info: dict, strict: bool = True) -> dict:
    """Receive a round and copy it into a transformers (or any torch) model's parameters/buffers.

    `strict`: every name in the round must exist in the model. Returns stats with `load_s`.
    """
    import torch

    device = next(model.parameters()).device
    named, stats = receive_named_tensors(round_info, 0, "cpu")
    t0 = time.monotonic()
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    unknown = [n for n, _ in named if n not in targets]
    if unknown and strict:
        raise KeyError(f"round {round_info['round_id']} names tensors the model lacks: {unknown[:5]}")
    with torch.no_grad():
        for name, t in named:
            if name in targets:
                targets[name].copy_(t.to(device))
    stats.update(load_s=time.monotonic() - t0, version=round_info["version"], loaded=len(named) - len(unknown))
    return stats
