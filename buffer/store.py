"""What a replay buffer keeps on disk (`buffer.state_dir`): one append-only log of msgpack records.

    ["base", next_group, next_lease_id, n_dropped, version, [open group ids]]   after a compaction
    ["lease", lease_id, [group ids]]     a grant; fresh group ids extend the issued range
    ["group", group_id, [frames]]        an accepted complete group: its scored-rollout frames as received
    ["served", [group ids]]              every rank fetched the step these groups were in
    ["dropped", [group ids]]             stale, failed or overflowed: never served, never issued again
    ["version", v]                       the learner's version moved
    ["counters", {name: value}]          metrics counters, at each summary and at shutdown

Replaying the log gives the groups accepted and not yet served (they are queued again) and the
groups issued but never answered (issued again). Loading compacts the log to a `base` record plus
the unserved groups, so it does not grow across restarts. Records are flushed to the OS each
iteration of the buffer's loop (not fsynced): a killed buffer loses nothing; a lost machine may.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

log = logging.getLogger("buffer.store")

LOG_NAME = "buffer.log"


class StateLocked(RuntimeError):
    """Another live buffer holds the state dir."""


@dataclass
class Restored:
    next_group: int = 0
    next_lease_id: int = 1
    n_dropped: int = 0
    version: int = 0
    counters: Counter = field(default_factory=Counter)
    open_groups: list[int] = field(default_factory=list)  # issued, neither accepted nor dropped
    groups: dict[int, list[bytes]] = field(default_factory=dict)  # accepted, not served
    records: int = 0
    bad_records: int = 0


class StateStore:
    def __init__(self, state_dir: str):
        self.dir = Path(state_dir)
        self.path = self.dir / LOG_NAME
        self._f = None
        self._lock = None
        self._dirty = False

    def lock(self) -> None:
        """Hold `state_dir/lock` while this process lives: two buffers appending to one log would corrupt it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.dir / "lock", "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise StateLocked(f"{self.dir} is in use by another buffer (it holds {self.dir / 'lock'})") from None

    def exists(self) -> bool:
        return self.path.is_file() and self.path.stat().st_size > 0

    # ---- reading ---------------------------------------------------------------------------

    def load(self) -> Restored:
        """Replay the log, then rewrite it compacted. A truncated last record (a kill mid-write) is ignored."""
        r = Restored()
        open_ids: set[int] = set()
        with open(self.path, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=(1 << 31) - 1, strict_map_key=False)
            try:
                for rec in unpacker:
                    r.records += 1
                    if not self._apply(rec, r, open_ids):
                        r.bad_records += 1
            except (ValueError, msgpack.UnpackException) as e:
                log.warning("%s: stopped reading at a corrupt record (%s); the rest is ignored", self.path, e)
                r.bad_records += 1
        r.open_groups = sorted(open_ids)
        self._compact(r)
        return r

    @staticmethod
    def _apply(rec, r: Restored, open_ids: set[int]) -> bool:
        if not (isinstance(rec, list) and rec and isinstance(rec[0], str)):
            return False
        kind, args = rec[0], rec[1:]
        try:
            if kind == "base":
                r.next_group, r.next_lease_id, r.n_dropped, r.version, ids = args
                open_ids.clear()
                open_ids.update(ids)
                r.groups.clear()
            elif kind == "lease":
                lease_id, ids = args
                r.next_lease_id = max(r.next_lease_id, lease_id + 1)
                top = max(ids, default=-1)
                if top >= r.next_group:  # fresh ids are issued in order
                    open_ids.update(range(r.next_group, top + 1))
                    r.next_group = top + 1
            elif kind == "group":
                gid, frames = args
                open_ids.discard(gid)
                r.groups[gid] = [bytes(x) for x in frames]
            elif kind == "served":
                for gid in args[0]:
                    r.groups.pop(gid, None)
            elif kind == "dropped":
                for gid in args[0]:
                    open_ids.discard(gid)
                    r.groups.pop(gid, None)
                r.n_dropped += len(args[0])
            elif kind == "version":
                r.version = max(r.version, args[0])
            elif kind == "counters":
                r.counters = Counter(args[0])
            else:
                return False
        except (TypeError, ValueError):
            return False
        return True

    def _compact(self, r: Restored) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_pack(["base", r.next_group, r.next_lease_id, r.n_dropped, r.version, r.open_groups]))
            f.write(_pack(["counters", dict(r.counters)]))
            for gid in sorted(r.groups):
                f.write(_pack(["group", gid, r.groups[gid]]))
        os.replace(tmp, self.path)

    # ---- writing ---------------------------------------------------------------------------

    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")

    def _append(self, rec: list) -> None:
        self._f.write(_pack(rec))
        self._dirty = True

    def lease(self, lease_id: int, group_ids: list[int]) -> None:
        self._append(["lease", lease_id, group_ids])

    def group(self, group_id: int, frames: list[bytes]) -> None:
        self._append(["group", group_id, frames])

    def served(self, group_ids: list[int]) -> None:
        self._append(["served", group_ids])

    def dropped(self, group_ids: list[int]) -> None:
        self._append(["dropped", group_ids])

    def version(self, version: int) -> None:
        self._append(["version", version])

    def counters(self, counters: dict) -> None:
        self._append(["counters", dict(counters)])

    def flush(self) -> None:
        if self._dirty:
            self._f.flush()
            self._dirty = False

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            self._f.close()
            self._f = None


def _pack(rec: list) -> bytes:
    return msgpack.packb(rec, use_bin_type=True)
