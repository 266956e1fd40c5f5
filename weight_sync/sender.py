"""The sending end, on learner rank 0: broadcast each version, straight from the learner's tensors.

    sender = WeightSender.from_config(cfg)                 # cfg: the `weight_sync:` section
    stats = sender.publish(step, model_named_full_tensors)  # HF names, full tensors (copied as they come)
    stats = sender.publish(step, adapter_tensors, adapter={"r": 8, "lora_alpha": 16, "target_modules": [...]})

`publish` never blocks longer than `timeout_s`: it waits `join_timeout_s` at most for the round's
members to show up (a generator joins at its next poll), broadcasts, and drops any member that has
not received everything by the deadline (`weight_sync/round.py` has the round's keys and how a
member dying mid-broadcast is survived, `weight_sync/broadcast.py` the attempts). It never waits
for a generator to finish a batch: one still busy after `join_timeout_s` is caught up later, as
below.

Members on this host take the version from the sender's shared-memory slot instead of the
broadcast (`weight_sync/shm.py`): once a round has had such members `publish` gathers straight
into the slot, `_run_round` writes the version there if the gather did not and reads their
reports alongside the broadcast, and a member on the sender's own GPU, which no NCCL group can
hold, is refused (`_same_device`: for that round only while the slot can still move there).

The sender holds the version as flat buckets, the layout members receive into (`buckets.py`): as
`publish` iterates the learner's tensors it copies each into its place there (`buckets.gather`;
the learner hands over its parameters, or ZeRO-3's gathered ones, without a copy of its own), and
the round broadcasts each bucket whole. Nothing is packed before the broadcast and nothing of the
caller's is kept: the tensors may change as soon as `publish` has moved past them.

Catch-up rounds. A generator that is behind the current version (a newcomer, or one that missed
a round because it was busy or late) is offered a catch-up round at its next poll. The sender
keeps the latest version's buckets (`keep_latest`, one model copy in host memory) and serves those
rounds from a background thread (`serve_in_background`): it asks the service every
`serve_interval_s` whether a catch-up round is pending and broadcasts those buckets to its
members. The learner's loop is never involved, and a new generator gets the current weights
within about `serve_interval_s` plus one transfer, even while the learner waits for data. Without
the thread, the learner calls `serve_pending()` once per step. Rounds never overlap: a lock
serialises publish and catch-up, and a publish waiting on it still keeps its own deadline.

Disk backend: the tensors go to `<disk_dir>/v<version>/model.safetensors` (written to a
temporary folder, then renamed) and the round carries the path; the sender does not wait for
anyone, and the service serves catch-ups from the latest folder by itself.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from typing import Iterable

import msgspec

from common.channel import Channel
from common.guards import WarnLimiter
from common.wire import expect
from weight_sync import buckets as bk
from weight_sync.broadcast import Broadcast, collect
from weight_sync.client import ask, channel
from weight_sync.config import WeightSyncConfig
from weight_sync.groups import SenderGroups
from weight_sync.messages import Adapter, Go, Idle, PendingRequest, Ready, RoundResult, RoundStats, SameHost
from weight_sync.round import RoundStore, pause, process_alive, store_server
from weight_sync.shm import REFUSE, Segment, bases, device_uuid, host_id, route, same_device_error, slot_device

log = logging.getLogger("conveyor.weight_sync.sender")


def _local_address(host: str, port: int) -> str:
    """The address of this machine's interface that reaches `host` (what generators should dial)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _with(cfg, **fields):
    """A copy of the settings `cfg` with `fields` changed (a dataclass or a pydantic model)."""
    unknown = sorted(k for k in fields if not hasattr(cfg, k))
    if unknown:
        raise TypeError(f"unknown weight-sync setting(s) {unknown}: see weight_sync.config.WeightSyncConfig")
    cfg = copy.copy(cfg)
    for k, v in fields.items():
        setattr(cfg, k, v)
    return cfg


class WeightSender:
    """Publishes versions from learner rank 0 (see the module docstring)."""

    def __init__(self, cfg: WeightSyncConfig | str = "127.0.0.1", port: int | None = None,
                 timeout_s: float | None = None, *, sender_id: str = "learner0", context=None, **fields):
        """`cfg`: the `weight_sync:` section (its sender fields: backend, bucket_mb, join_timeout_s,
        keep_latest, serve_in_background, ...), or the service's host for a section of defaults;
        `port`, `timeout_s` and `fields` change it."""
        if isinstance(cfg, str):
            cfg = WeightSyncConfig(host=cfg)
        fields.update({k: v for k, v in (("port", port), ("timeout_s", timeout_s)) if v is not None})
        cfg = _with(cfg, **fields)
        backend = cfg.backend
        if backend == "auto":
            import torch

            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("gloo", "nccl", "disk"):
            raise ValueError(f"weight_sync.backend={backend!r} must be auto, gloo, nccl or disk")
        if backend == "disk" and not cfg.disk_dir:
            raise ValueError("weight_sync.backend='disk' needs weight_sync.disk_dir")
        self.cfg = cfg
        self.backend = backend
        self.timeout_s = float(cfg.timeout_s)
        self.join_timeout_s = min(float(cfg.join_timeout_s), self.timeout_s)
        self.bucket_bytes = int(cfg.bucket_mb * (1 << 20))
        self.keep_latest = cfg.keep_latest
        self.advertise_host = cfg.advertise_host or _local_address(cfg.host, cfg.port)
        self.sender_id = sender_id
        self._ctx = context
        self._tls = threading.local()  # one control socket per thread
        self._lock = threading.Lock()  # one round at a time
        self._store = None  # the rendezvous store's server, opened on the first group round
        # Every key of it is under this prefix, which only the service and the rounds' members get
        # (over CurveZMQ when it is on): a stranger who reaches the store cannot find a key to join
        # a roster or a group by (the store has no way to list its keys).
        self._secret = secrets.token_hex(16)
        self._groups = SenderGroups()  # broadcast groups kept between rounds (groups.py)
        # the shared-memory segment for generators on this host (weight_sync/shm.py); on NCCL the
        # slot may move to this rank's device, but only once a member asks for that (`served`)
        dev = slot_device(backend) if backend != "disk" else None
        self._device_uuid = device_uuid(dev) if dev is not None else ""  # a member on it never joins NCCL
        self._segment = Segment(cfg.shm_dir, sender_id, then=dev, uuid=self._device_uuid) \
            if cfg.same_host != "broadcast" and backend != "disk" else None
        self._warnings = WarnLimiter(log, every_s=300.0)
        self._in_slot = False  # the buckets of `_flat` are views of a same-host slot (not gathered into again)
        self._flat: tuple[bk.Manifest, list] | None = None  # the latest version's layout and buckets
        self._latest: tuple[int, bk.Manifest, list] | None = None  # (version, manifest, buckets) for catch-ups
        self._last_pending_call: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_stats: dict = {}
        if cfg.serve_in_background and backend != "disk" and cfg.keep_latest:
            self._thread = threading.Thread(target=self._serve_loop, name="weight-sync-catch-up", daemon=True)
            self._thread.start()

    @classmethod
    def from_config(cls, cfg: WeightSyncConfig, **overrides) -> "WeightSender":
        """From the `weight_sync:` section; `overrides`: fields of it to change (e.g. host, port,
        timeout_s), or `sender_id` / `context`."""
        return cls(cfg, **overrides)

    # ---- the learner's calls ---------------------------------------------------------------

    def publish(self, version: int, named_tensors: Iterable, adapter: Adapter | dict | None = None) -> dict:
        """Send version `version` to every registered generator; return the round's stats.

        `named_tensors`: (HF name, full CPU tensor) pairs; consumed once (it may be a generator
        that gathers ZeRO-3 shards as it goes). `adapter`: the tensors are a LoRA adapter (peft's
        names) of this rank, alpha and modules; None: the full weights. Never raises for a
        generator's or the service's failure: those end up in the stats (`failed`, `missed`, `error`).
        """
        if adapter is not None and not isinstance(adapter, Adapter):
            adapter = msgspec.convert(adapter, Adapter)
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        stats = {"version": version, "backend": self.backend, "members": [], "ok": [], "missed": [], "failed": [],
                 "error": ""}
        # the lock first: the gather writes into the buckets a catch-up round may be sending
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            for _ in named_tensors:  # walked to the end all the same: under ZeRO-3 it is a collective
                pass
            stats["error"] = "a catch-up round held the sender past the publish deadline"
            return self._finish(stats, t0)
        try:
            self._latest = None
            t_gather = time.monotonic()
            # the learner's gather happens as this iterates; each tensor is copied into its bucket,
            # which is the same-host slot's once a round has had members on this host
            prev, slot = self._flat, None
            if prev is not None and self._segment is not None:
                slot = self._segment.begin(version, prev[0])
                prev = (prev[0], slot) if slot is not None else prev if not self._in_slot else None
            buckets = None
            try:
                manifest, buckets = self._flat = bk.gather(named_tensors, self.bucket_bytes, prev)
            finally:
                if slot is not None:
                    self._segment.end(ok=buckets is slot)
            self._in_slot = slot is not None and buckets is slot
            stats.update(bytes=manifest.total_bytes, buckets=len(manifest.buckets), tensors=len(manifest.tensors),
                         gather_s=time.monotonic() - t_gather)
            self._latest = (version, manifest, buckets) if self.keep_latest and self.backend != "disk" else None
            if self.backend == "disk":
                named = bk.unpack(manifest, buckets)
                return self._finish(self._publish_disk(version, manifest, named, stats, deadline, adapter), t0)
            store = self._server()
            ready = Ready(self.sender_id, version, self.backend, manifest, self.advertise_host, store.port, "",
                          self.keep_latest, self.timeout_s, self.join_timeout_s, adapter=adapter,
                          shm=self._same_host(manifest), secret=self._secret)
            try:
                go = expect(ask(self._channel(), ready, timeout_s=max(0.001, deadline - time.monotonic())), Go)
            except Exception as e:  # the service is down, refused or answered nonsense: the learner goes on
                stats["error"] = f"service: {e}"
                return self._finish(stats, t0)
            for rid in go.cancelled:  # unclaimed catch-up rounds of the previous version: release them
                self._abort(rid)
            stats.update(self._run_round(go, manifest, buckets, self._round_deadline(deadline)))
            self._report(go, stats, deadline)
            return self._finish(stats, t0)
        finally:
            self._lock.release()

    def serve_pending(self) -> dict | None:
        """Serve a catch-up round if the service has one pending; its stats, or None.

        Cheap when there is nothing to do (one control request). The background thread calls it;
        without the thread, call it once per learner step.
        """
        now = time.monotonic()
        if self._thread is not None and threading.current_thread() is self._thread:
            next_within = 2 * self.cfg.serve_interval_s + 0.5
        else:  # called by the learner's loop: expect the next call after about one more step
            prev, self._last_pending_call = self._last_pending_call, now
            next_within = 2 * (now - prev) + 1.0 if prev is not None else 5.0
        if not self._lock.acquire(blocking=False):
            return None  # a publish is running; it already includes everyone it can
        try:
            latest = self._latest
            if latest is None or self.backend == "disk":
                return None
            version, manifest, buckets = latest
            try:  # a short wait: this runs every step (or every tick), and must not stall on a dead service
                reply = expect(ask(self._channel(), PendingRequest(self.sender_id, version, next_within),
                                   timeout_s=min(self.timeout_s, 2.0)), Idle, Go)
            except Exception as e:
                log.warning("asking the weight-sync service for catch-up rounds: %s", e)
                return None
            if isinstance(reply, Idle):
                return None
            t0 = time.monotonic()
            deadline = t0 + self.timeout_s
            stats = {"version": version, "backend": self.backend, "bytes": manifest.total_bytes,
                     "buckets": len(manifest.buckets), "tensors": len(manifest.tensors), "gather_s": 0.0,
                     "catch_up": True, "error": ""}
            if reply.version != version:  # a publish overtook it: nobody may load a mislabelled version
                self._abort(reply.round_id)
                workers = [m.worker_id for m in reply.members]
                stats.update(round_id=reply.round_id, members=workers, ok=[], failed=[], missed=workers,
                             error=f"round asked for v{reply.version}")
            else:
                stats.update(self._run_round(reply, manifest, buckets, self._round_deadline(deadline)))
            self._report(reply, stats, deadline)
            return self._finish(stats, t0)
        finally:
            self._lock.release()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s + 5)
        ch = getattr(self._tls, "channel", None)
        if ch is not None:
            ch.close()
        self._groups.clear()
        self._store = None
        self._latest = None
        if self._segment is not None:
            self._segment.close()

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals -------------------------------------------------------------------------

    def _channel(self) -> Channel:
        ch = getattr(self._tls, "channel", None)
        if ch is None:
            ch = self._tls.channel = channel(self.cfg.host, self.cfg.port, self.timeout_s, self._ctx)
        return ch

    def _server(self):
        if self._store is None:
            self._store = store_server(self.advertise_host, self.timeout_s)
        return self._store

    def _round_store(self, round_id: int, timeout_s: float) -> RoundStore:
        return RoundStore(self.advertise_host, self._server().port, round_id, timeout_s, self._secret)

    def _finish(self, stats: dict, t0: float) -> dict:
        stats["total_s"] = time.monotonic() - t0
        self.last_stats = stats
        if stats.get("error"):
            log.warning("weight round v%s: %s", stats.get("version"), stats["error"])
        return stats

    def _abort(self, round_id: int) -> None:
        """Release members waiting on a round that will not run."""
        self._round_store(round_id, 5.0).set_roster(0, [], abort=True)

    def _same_host(self, manifest: bk.Manifest) -> SameHost | None:
        """The segment's description for the round (its file exists, sized for `manifest`)."""
        if self._segment is None:
            return None
        try:
            self._segment.ensure(manifest)
        except (OSError, RuntimeError) as e:  # no room in /dev/shm or on the device: everyone takes the broadcast
            self._warnings.warn("segment", "no same-host segment in %s (%s): same-host generators take the broadcast",
                                self.cfg.shm_dir, e)
            return None
        return SameHost(self._segment.path, self._segment.nonce, host_id(), self.cfg.same_host == "shm",
                        self._segment.ipc)

    def _same_device(self, rs: RoundStore, todo: list[int], manifest: bk.Manifest) -> tuple[dict[int, bool], bool]:
        """The broadcast joiners on this rank's own GPU (`shm.route`: NCCL cannot hold them), each
        told why it is left out (`RoundStore.refuse`) before any roster is written, and whether
        the slot should move to the device for them (`Segment.served`).

        Returns ({rank: final}, wants_device). `final`: no slot can serve it (the slot is on the
        device already, or cannot go there), a configuration error that the round's `error` and
        the member's `RoundRefused` spell out; else it catches up from the next round's device
        slot (it is counted missed)."""
        if self.backend != "nccl" or not self._device_uuid:
            return {}, False
        seg = self._segment
        movable = seg is not None and seg.device is None and seg.then is not None
        refused: dict[int, bool] = {}
        for r in todo:
            uuid, _ = rs.device_of(r)
            # it joined the broadcast: whatever slot this round offered, it could not use it
            if route(self.backend, uuid == self._device_uuid, False, False) != REFUSE:
                continue
            refused[r] = not movable
            if movable:
                rs.refuse(r, f"rank {r}: left out of round {rs.round_id}: its engine is on GPU {uuid}, the GPU of "
                             f"learner rank 0, where NCCL cannot reach it; a slot on that GPU (CUDA IPC) is "
                             f"offered from the next round")
            else:
                why = same_device_error(r, uuid, self.cfg.shm_dir, bases(manifest)[-1],
                                        seg is not None and seg.device is not None)
                rs.refuse(r, why)
                self._warnings.warn("same-device", "%s", why)
        return refused, movable and bool(refused)

    def _round_deadline(self, deadline: float) -> float:
        """The data plane stops a little before `deadline`, so the round's report still fits."""
        return deadline - min(0.5, 0.1 * self.timeout_s)

    def _report(self, go: Go, stats: dict, deadline: float) -> None:
        kept = RoundStats(**{k: stats[k] for k in RoundStats.__struct_fields__ if k in stats})
        result = RoundResult(go.round_id, go.version, list(stats.get("ok", [])), list(stats.get("missed", [])),
                             list(stats.get("failed", [])), kept)
        try:
            ask(self._channel(), result, timeout_s=max(0.05, min(5.0, deadline - time.monotonic())))
        except Exception as e:
            stats["error"] = (stats.get("error") or "") + f" (round_result not delivered: {e})"

    def _run_round(self, go: Go, manifest: bk.Manifest, buckets: list, deadline: float) -> dict:
        """Join, broadcast (with retries), collect; returns the round's part of the stats."""
        out = {"round_id": go.round_id, "members": [m.worker_id for m in go.members], "ok": [], "missed": [],
               "failed": [], "same_host": 0, "join_s": 0.0, "broadcast_s": 0.0, "attempts": 0,
               "ready_s": 0.0, "setup_s": 0.0, "transfer_s": 0.0, "confirm_s": 0.0}
        if not go.members:
            return out
        owner = {r: m.worker_id for m in go.members for r in m.ranks}  # group rank -> worker id
        rs = self._round_store(go.round_id, max(1.0, deadline - time.monotonic()))

        # 1. join: members arrive at their next poll; wait join_timeout_s at most
        t_join = time.monotonic()
        join_deadline = min(t_join + self.join_timeout_s, deadline)
        pending = set(owner)
        via: dict[int, str] = {}  # rank -> "shm" | "broadcast"
        while pending and time.monotonic() < join_deadline:
            for r in list(pending):
                kind = rs.joined(r)
                if kind is not None:
                    via[r] = kind
                    pending.discard(r)
            if pending:
                pause(t_join)
        absent_workers = {owner[r] for r in pending}
        present = sorted(r for r in owner if owner[r] not in absent_workers)
        shm_ranks = [r for r in present if via.get(r) == "shm"]
        todo = [r for r in present if via.get(r) != "shm"]
        out["join_s"] = time.monotonic() - t_join
        refused, wants_device = self._same_device(rs, todo, manifest)
        todo = [r for r in todo if r not in refused]
        wants_device = wants_device or any(rs.device_of(r)[1] for r in shm_ranks)

        # 1b. members on this host: the version into the shared-memory segment, once
        if shm_ranks:
            out["shm_s"] = self._segment.write(go.version, manifest, buckets) if self._segment.written != go.version \
                else 0.0
            rs.set_shm_roster(shm_ranks)

        # 2. the broadcast to the others, attempt after attempt (broadcast.py)
        ok_ranks, dead_ranks = Broadcast(rs, self.backend, self.timeout_s, self.bucket_bytes, self._groups,
                                         self.cfg).run(todo, go.members, manifest, buckets, deadline, out)
        if shm_ranks:  # their reads ran alongside the broadcast; a process gone, or silence by the
            # deadline, means failed
            pids = {r: rs.process_of(r) for r in shm_ranks}
            reports = collect(rs, "shm", shm_ranks, deadline, None,
                              gone=lambda r: pids[r] is not None and not process_alive(pids[r]))
            ok_ranks |= {r for r, ok in reports.items() if ok}
            dead_ranks |= {r for r in shm_ranks if not reports.get(r)}
            out["same_host"] = sum(1 for r in shm_ranks if reports.get(r))
        if (shm_ranks or wants_device) and self._segment is not None:
            self._segment.served(device_wanted=wants_device)
        # refused for this round only (the slot is offered on the device from the next): missed
        absent_workers |= {owner[r] for r, final in refused.items() if not final}
        failed = {owner[r] for r in dead_ranks} | {owner[r] for r in owner
                                                   if owner[r] not in absent_workers and r not in ok_ranks}
        out["missed"] = sorted(absent_workers)
        out["failed"] = sorted(failed)
        out["ok"] = sorted({owner[r] for r in owner} - absent_workers - failed)
        return out

    def _publish_disk(self, version: int, manifest: bk.Manifest, named: list, stats: dict,
                      deadline: float, adapter: Adapter | None = None) -> dict:
        from safetensors.torch import save_file

        t0 = time.monotonic()
        disk_dir = self.cfg.disk_dir
        os.makedirs(disk_dir, exist_ok=True)
        final = os.path.join(disk_dir, f"v{version:08d}")
        tmp = final + f".tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        # clone: safetensors refuses tensors that share storage (a tied embedding, a caller's views)
        save_file({n: t.detach().cpu().clone() for n, t in named}, os.path.join(tmp, "model.safetensors"),
                  metadata={"version": str(version)})
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump({"version": version, "manifest": msgspec.to_builtins(manifest)}, f)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        stats["write_s"] = time.monotonic() - t0
        old = sorted(d for d in os.listdir(disk_dir) if d.startswith("v") and ".tmp" not in d)
        for d in old[:-self.cfg.disk_keep]:
            shutil.rmtree(os.path.join(disk_dir, d), ignore_errors=True)
        ready = Ready(self.sender_id, version, "disk", manifest, "", 0, os.path.abspath(final), False,
                      self.timeout_s, self.join_timeout_s, adapter=adapter)
        try:
            go = ask(self._channel(), ready, timeout_s=max(0.001, deadline - time.monotonic()))
        except Exception as e:
            stats["error"] = f"service: {e}"
            return stats
        # generators load at their next poll and report done to the service; nothing to wait for
        stats.update(round_id=go.round_id, members=[m.worker_id for m in go.members], path=os.path.abspath(final))
        return stats

    def _serve_loop(self) -> None:
        while not self._stop.wait(self.cfg.serve_interval_s):
            try:
                self.serve_pending()
            except Exception as e:  # never let the thread die: the next tick tries again
                log.warning("catch-up round failed: %s", e)
        ch = getattr(self._tls, "channel", None)
        if ch is not None:
            ch.close()
