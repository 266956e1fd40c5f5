"""The sender's broadcast of one round: attempt after attempt, one group each, until every member
that joined it has the version or is given up.

`sender.WeightSender._run_round` waits for the members to join, serves those on its host from
the shared-memory segment and hands the rest to `Broadcast.run` (the keys of an attempt are in
`weight_sync/round.py`, the groups in `weight_sync/groups.py`):

- each attempt serves the next `weight_sync.group_size` ranks still to serve (all of them when it
  is 0), the others named `later` in its roster; the roster offers a kept group of exactly these
  members, which is used again when every one of them says it holds it;
- a rank silent since it joined (no `ready` within `setup_timeout_s`) is dropped, and the others
  go on in the next attempt;
- the buckets go out from group rank 0 (`Broadcast.send`), every wait bounded by the round's
  deadline; then the members' reports (`collect`): whoever reports `err` is served again, up to
  `max_attempts` tries, and silence means dead.
"""

from __future__ import annotations

import time

from weight_sync import buckets as bk
from weight_sync.groups import AbortAt, Bounded, SenderGroups, failed_group, retire
from weight_sync.round import Go as GroupGo
from weight_sync.round import RoundStore, pause

# After the first sign of trouble in an attempt (an `err` report, a failed broadcast), the others'
# reports are awaited this long at least: a member tearing its group down takes a moment to say so.
GRACE_S = 5.0


class Broadcast:
    """Round `rs`'s broadcasts from the sender (group rank 0): `backend` gloo or nccl, each
    collective bounded by `timeout_s` (a kept group serves later rounds), at most ~`bucket_bytes`
    copied to the device ahead of the collectives (NCCL), the groups kept in `groups`; `cfg`
    gives `group_size`, `setup_timeout_s` and `max_attempts`."""

    def __init__(self, rs: RoundStore, backend: str, timeout_s: float, bucket_bytes: int, groups: SenderGroups, cfg):
        self.rs, self.backend, self.timeout_s, self.bucket_bytes = rs, backend, timeout_s, bucket_bytes
        self.groups, self.cfg = groups, cfg

    def run(self, todo: list[int], round_members, manifest: bk.Manifest, buckets: list, deadline: float,
            out: dict) -> tuple[set[int], set[int]]:
        """Serve ranks `todo` (of `round_members`, the round's `Member`s) the buckets; adds the
        attempts' timings to `out` and returns (the ranks that have the version, the ranks given up)."""
        rs = self.rs
        # attempts: each broadcasts to the next `group_size` ranks still to serve (all of them
        # when it is 0); whoever reports `err` is served again, up to max_attempts tries; silence
        # means dead. The ranks after this attempt's are named in its roster as `later`.
        ok_ranks: set[int] = set()
        dead_ranks: set[int] = set()
        tries: dict[int, int] = {}
        size = self.cfg.group_size or len(todo)
        place = {r: (m.worker_id, r - m.first_rank) for m in round_members for r in m.ranks}  # who holds a group rank
        # by worker, not by the order they polled in: the same generators make the same groups
        # round after round, which can then be kept (groups.py: "groups kept between rounds")
        pending, attempt = sorted(todo, key=lambda r: place[r]), 0
        t_bcast = time.monotonic()
        while pending:
            if time.monotonic() >= deadline - 0.5:
                dead_ranks |= set(pending)
                break
            todo, pending = pending[:size], pending[size:]
            t_ready = time.monotonic()
            offer, order = self.groups.offer(place[r] for r in todo)  # a kept group of exactly these members
            if offer:  # listed in its group-rank order
                todo = sorted(todo, key=lambda r: order.index(place[r]))
            members = [place[r] for r in todo]
            rs.set_roster(attempt, todo, later=pending, group=offer)
            ready = rs.wait_ready(attempt, todo, min(deadline, time.monotonic() + self.cfg.setup_timeout_s))
            out["ready_s"] += time.monotonic() - t_ready
            if len(ready) < len(todo):  # silent since they joined: the others go on without them
                dead_ranks |= set(todo) - set(ready)
                pending = sorted(ready) + pending
                attempt += 1
                continue
            reuse = bool(offer) and all(ready[r] == offer for r in todo)
            if offer and not reuse:  # someone no longer holds it
                self.groups.drop(offer)
            gid = offer if reuse else self.groups.new_id()
            rs.set_go(attempt, GroupGo(gid, reuse))
            err, setup_s, transfer_s, pg = self.send(attempt, todo, bk.targets(manifest, buckets), deadline,
                                                     self.groups.get(gid) if reuse else None)
            if err:
                self.groups.forget(gid)  # ended by send; its last reference goes with `pg` below
            elif not reuse:
                self.groups.keep(gid, members, pg)
            out["setup_s"] += setup_s
            out["transfer_s"] += transfer_s
            out["groups_reused"] = out.get("groups_reused", 0) + int(reuse and not err)
            t_confirm = time.monotonic()
            reports = collect(rs, attempt, todo, deadline,
                              grace_s=max(GRACE_S, 2 * (setup_s + transfer_s)) if err else None)
            out["confirm_s"] += time.monotonic() - t_confirm
            del pg
            if not err and not all(reports.get(r) for r in todo):
                # after the reports: a group torn down early could fail a member still receiving
                retire(self.groups.forget(gid))
            ok_ranks |= {r for r, ok in reports.items() if ok}
            dead_ranks |= set(todo) - set(reports)
            attempt += 1
            again = []
            for r in sorted(r for r, ok in reports.items() if not ok):
                tries[r] = tries.get(r, 0) + 1
                if tries[r] < self.cfg.max_attempts:
                    again.append(r)
                else:
                    dead_ranks.add(r)
            pending = again + pending
        rs.set_roster(attempt, [], abort=True)  # releases anyone still waiting (the refused too)
        out["broadcast_s"] = time.monotonic() - t_bcast
        out["attempts"] = attempt
        return ok_ranks, dead_ranks

    def send(self, attempt: int, todo: list[int], sources: list, deadline: float, pg=None):
        """One attempt as group rank 0, through `pg` (a kept group) or a new one; returns
        (error or "", setup seconds, transfer seconds, group).

        Every unit's collective is issued before the first is waited for (gloo and NCCL run them in
        order), so no collective waits for the previous one's round trip. On NCCL, host sources
        are copied to the device as they go, at most ~`bucket_bytes` ahead of the oldest
        unfinished collective. Every wait ends by `deadline` (groups.py: `Bounded`, `AbortAt`),
        so a member that vanished costs this attempt, never the learner. On error the group is
        aborted and goes with its last reference (its closed connections make peers still
        waiting on us fail fast); otherwise the caller keeps it."""
        import torch

        t0 = time.monotonic()
        work = inflight = None
        try:
            if pg is None:
                pg = self.rs.group(self.backend, attempt, 0, 1 + len(todo), deadline, self.timeout_s)
            t1 = time.monotonic()
            inflight: list = []  # (work, bytes it holds on the device)
            held = 0
            with AbortAt(pg, deadline):
                group = Bounded(pg, deadline)
                for src in sources:
                    dev = 0
                    if self.backend == "nccl" and src.device.type != "cuda":
                        src = src.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
                        dev = src.numel()
                    inflight.append((group.broadcast(src, 0), dev))
                    held += dev
                    while held > self.bucket_bytes and len(inflight) > 1:
                        work, n = inflight.pop(0)
                        work.wait()
                        held -= n
                for work, _ in inflight:
                    work.wait()
                if self.backend == "nccl":
                    torch.cuda.synchronize()
            return "", t1 - t0, time.monotonic() - t1, pg
        except Exception as e:
            # the group goes now, with the collectives still queued on it (they hold it)
            e.__traceback__ = None
            failed_group(pg, e)
            work = inflight = group = pg = None
            return f"{type(e).__name__}: {e}", time.monotonic() - t0, 0.0, None


def collect(rs: RoundStore, attempt, todo: list[int], deadline: float, grace_s: float | None,
            gone=None) -> dict[int, bool]:
    """Members' ok/err reports; stop at the deadline, or `grace_s` after the first sign of trouble.
    `gone(rank)`: whether that member's process has exited (then it counts as `err`; its report,
    were one written just before, is read first)."""
    reports: dict[int, bool] = {}
    since = time.monotonic()
    stop = deadline if grace_s is None else min(deadline, since + grace_s)
    while True:
        for r in todo:
            if r in reports:
                continue
            ok = rs.report_of(attempt, r)
            if ok is None and gone is not None and gone(r):
                ok = rs.report_of(attempt, r) or False
            if ok is None:
                continue
            reports[r] = ok
            if not ok and grace_s is None and attempt != "shm":  # a broadcast in trouble: the
                # others get a grace period (same-host reads are independent of each other)
                grace_s = GRACE_S
                stop = min(deadline, time.monotonic() + grace_s)
        if len(reports) == len(todo) or time.monotonic() >= stop:
            return reports
        pause(since)
