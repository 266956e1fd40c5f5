"""The replay buffer's bookkeeping: admission control, leases, groups, batches and resume.

No sockets and no decoding here: `buffer/service.py` turns messages into calls on `BufferState`
and its return values into replies. The rules that tests check against hand-worked values
(`admission_limit`, `is_stale`, `share_bounds`) are plain functions in `buffer/rules.py`; the
prompt dataset and its order are `buffer/prompts.py`.

Life of a prompt group k (counted from 0 over the whole run):

    issued (leased) ──all n samples in──> ready ──batch for a step──> served ──step trained──> in the ledger
        │   │                  │            │
        │   │                  │            └─ too old for the step: dropped (stale)
        │   │                  └─ no reward signal, with buffer.dynamic_filtering: dropped (filtered)
        │   └─ lease expired: back to the front of the queue, issued again under a new lease
        └─ failed sample / GroupFailed: dropped

A drop frees an admission slot (`k_live` = issued - dropped), so a replacement prompt is leased by
itself: dynamic sampling (DAPO) keeps every step at prompts_per_step groups whose rewards differ,
filtering at most dynamic_filtering_max_rounds x prompts_per_step groups per learner version.

Resume (`BufferState.resume`): the learner, restarted from its checkpoint at step N, says N and the
groups its lineage trained (its ledger). Every other group the buffer had served, leased or queued
with tokens newer than version N is issued again; stale drops judged at versions after N are undone
(issued again; failed, overflow and filtered drops are final); version N holds from then on. A
buffer restored from disk leases nothing until that handshake, so no generator works for a lineage
that no longer exists.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import Counter, deque

from buffer.config import BufferConfig
from buffer.groups import Lease, PendingGroup, ReadyGroup, RequestError, Sample, StepBatch  # noqa: F401 (re-exported)
from buffer.messages import LeaseGrant, Wait
from buffer.prompts import Prompt, PromptOrder, PromptsError, load_prompts, prompt_group  # noqa: F401 (PromptsError, load_prompts: re-exported)
from buffer.rules import (
    QUIET_S,
    admission_limit,
    admits,
    cap_message,
    describe_wait,
    filter_verdict,
    is_stale,
    share_bounds,
    share_stats,
)

LEASE_RETRY_S = 0.1  # what a generator is told to wait when admission or the data holds it back
BATCH_RETRY_S = 0.02  # a learner waiting for a batch polls faster: it is the critical path
KEEP_FETCHED_STEPS = 2  # batches kept after every rank fetched them, for a rank whose reply was lost
# always in `metrics`, 0 until they happen (a reader polling one never meets a missing key)
COUNTERS = ("accepted_groups", "accepted_rollouts", "dropped_stale", "dropped_overflow", "failed_groups",
            "filtered", "filter_cap_hits", "no_signal_groups", "unfiltered_past_cap", "late", "duplicates",
            "malformed", "reissued", "expired_leases", "leases", "served_groups", "served_rollouts", "relayed",
            "internal_errors", "resumes", "reissued_after_resume", "future_rollouts", "refused_old_weights",
            "refused_future_weights", "memory_resets", "refused_requests")

log = logging.getLogger("buffer")


class BufferState:
    """Everything the buffer knows; the service calls one method per request."""

    def __init__(self, cfg: BufferConfig, prompts: list[Prompt], store=None):
        self.cfg = cfg
        self.prompts = prompts
        self.order = PromptOrder(len(prompts), cfg.shuffle_seed, cfg.max_epochs)
        self.store = store  # `buffer.store.StateStore` or None; told about every change worth keeping
        self.version = 0  # the learner's version: max of SetVersion and the steps asked for
        self.next_group = 0  # groups issued for the first time so far (the next fresh group id)
        self.dropped: dict[int, tuple[str, int]] = {}  # group id -> (counter it went to, version then)
        self.next_lease_id = 1
        self.requeue: deque[int] = deque()  # groups whose lease expired, issued again before new ones
        self.pending: dict[int, PendingGroup] = {}  # group id -> group leased and not complete
        self.leases: dict[int, Lease] = {}
        # (expires_at, lease id) of every grant and renewal: `expire` pops what is due instead of
        # scanning every lease at every request; an entry of a lease since renewed or answered is skipped
        self.expiries: list[tuple[float, int]] = []
        self.ready: list[ReadyGroup] = []  # heap, oldest group id first
        # no group in `ready` has a token older than this (a lower bound, exact after each stale sweep):
        # while the stale floor is below it, moving the version needs no sweep of every queued group
        self.oldest_ready = math.inf
        self.batches: dict[int, StepBatch] = {}  # step -> batch not yet released
        self.released_steps: set[int] = set()
        self.next_step = 0  # one past the newest step a batch was assembled for
        self.awaiting_resume = False  # restored from disk: nothing is leased or served before `resume`
        self.last_staleness_mean = 0.0
        self.last_lease_request: float | None = None
        self.last_scored: float | None = None
        self.last_old_weights: float | None = None  # when a lease was last refused for old weights
        self.filtered_now = 0  # groups filtered at the current version (the cap counts per version)
        self.cap_hit_at = -1  # the version at which the filter cap was last reached
        self.counters: Counter[str] = Counter()

    # ---- leases ----------------------------------------------------------------------------

    @property
    def n_dropped(self) -> int:
        return len(self.dropped)

    @property
    def k_live(self) -> int:
        # Dropped groups are subtracted: the learner never trains on them, so if they still counted
        # the window would stay full of groups that will never arrive and the run would deadlock
        # (no lease admitted, no batch complete) after enough drops.
        return self.next_group - self.n_dropped

    def exhausted(self) -> bool:
        """Every group of every epoch issued, and none waiting to be issued again."""
        return self.next_group >= self.order.total and not self.requeue

    def lease(self, worker_id: str, max_groups: int, now: float, version: int | None = None) -> LeaseGrant | Wait:
        """Up to `max_groups` groups for `worker_id`, whose weights are at `version` (None: not said)."""
        self.last_lease_request = now
        self.expire(now)
        if self.awaiting_resume:
            return Wait("the buffer was restored from disk: waiting for the learner's resume handshake",
                        LEASE_RETRY_S)
        if version is not None and version > self.version:
            # only a lineage the learner no longer continues (it resumed from an earlier checkpoint) has these
            self.counters["refused_future_weights"] += 1
            return Wait(f"weights v{version} are newer than the learner's v{self.version}: load the learner's "
                        f"current weights first", LEASE_RETRY_S)
        if version is not None and version < self.version - self.cfg.max_staleness:
            self.counters["refused_old_weights"] += 1
            self.last_old_weights = now
            return Wait(f"weights v{version} are more than max_staleness={self.cfg.max_staleness} behind the "
                        f"learner's v{self.version}: every rollout would be dropped as stale; load newer weights",
                        LEASE_RETRY_S)
        group_ids = []
        while len(group_ids) < max_groups:
            if self.requeue:
                # already counted in k_live when first issued: issuing it again needs no admission
                group_ids.append(self.requeue.popleft())
                self.counters["reissued"] += 1
            elif self.next_group < self.order.total and admits(
                    self.k_live, self.version, self.cfg.max_staleness, self.cfg.prompts_per_step):
                group_ids.append(self.next_group)
                self.next_group += 1
            else:
                break
        if not group_ids:
            if self.exhausted():
                if not self.pending:
                    return Wait("dataset exhausted: all epochs issued and answered", LEASE_RETRY_S, done=True)
                return Wait(f"all prompts issued; {len(self.pending)} groups still leased", LEASE_RETRY_S)
            limit = admission_limit(self.version, self.cfg.max_staleness, self.cfg.prompts_per_step)
            return Wait(f"admission: {self.k_live} live groups, limit {limit} at version {self.version}",
                        LEASE_RETRY_S)
        lease_id = self.next_lease_id
        self.next_lease_id += 1
        for gid in group_ids:
            self.pending[gid] = PendingGroup(gid, lease_id, self.version)
        self.leases[lease_id] = Lease(lease_id, worker_id, set(group_ids), now + self.cfg.lease_ttl_s, now)
        heapq.heappush(self.expiries, (now + self.cfg.lease_ttl_s, lease_id))
        self.counters["leases"] += 1
        if self.store:
            self.store.lease(lease_id, group_ids)
        groups = []
        for gid in group_ids:
            groups.append(prompt_group(self.prompts[self.order.row(gid)], gid))
        return LeaseGrant(lease_id, groups, self.cfg.n_samples_per_prompt, self.cfg.lease_ttl_s, self.version)

    def renew(self, lease_id: int, now: float) -> None:
        self.expire(now)
        lease = self.leases.get(lease_id)
        if lease is None:
            raise RequestError("lease_renew.lease_id", f"lease {lease_id} is not active (expired, answered or unknown)")
        lease.expires_at = now + self.cfg.lease_ttl_s
        lease.renewed_at = now
        heapq.heappush(self.expiries, (lease.expires_at, lease_id))

    def expire(self, now: float) -> list[int]:
        """Put the groups of expired leases back at the front of the queue; returns them."""
        back, due = [], {}
        while self.expiries and self.expiries[0][0] <= now:
            _, lease_id = heapq.heappop(self.expiries)
            lease = self.leases.get(lease_id)
            if lease is not None and lease.expires_at <= now:  # (else renewed since, or answered)
                due[lease_id] = lease
        for lease_id in sorted(due):  # granted order, as before
            lease = self.leases.pop(lease_id)
            self.counters["expired_leases"] += 1
            for gid in sorted(lease.group_ids):
                # partial samples go too: a group is accepted from one lease, all of it
                del self.pending[gid]
                back.append(gid)
        if back:
            self.requeue.extendleft(reversed(back))  # front of the queue, oldest first
        return back

    def _finish_in_lease(self, g: PendingGroup) -> None:
        del self.pending[g.group_id]
        lease = self.leases.get(g.lease_id)
        if lease is not None:
            lease.group_ids.discard(g.group_id)
            if not lease.group_ids:
                del self.leases[g.lease_id]

    def _drop(self, group_ids: list[int], counter: str) -> None:
        for gid in group_ids:
            self.dropped[gid] = (counter, self.version)
        self.counters[counter] += len(group_ids)
        if self.store:
            self.store.dropped(group_ids, counter, self.version)

    def group_failed(self, lease_id: int, group_id: int) -> bool:
        """A generator gave the group up: drop it (not issued again). False if it was not its to give up."""
        g = self.pending.get(group_id)
        if g is None or g.lease_id != lease_id:
            self.counters["late"] += 1
            return False
        self._finish_in_lease(g)
        self._drop([group_id], "failed_groups")
        return True

    # ---- scored rollouts -------------------------------------------------------------------

    def add_sample(self, group_id: int, sample_index: int, lease_id: int, failed: bool,
                   min_version: int | None, reward: float, frame: bytes, max_version: int | None = None,
                   now: float = 0.0, filter_score: float | None = None) -> str:
        """One scored rollout; returns what became of it: accepted | complete | late | duplicate | failed | future."""
        self.last_scored = now
        g = self.pending.get(group_id)
        if g is None or g.lease_id != lease_id:
            self.counters["late"] += 1
            return "late"
        if max_version is not None and max_version > self.version:
            # sampled by weights the learner has not made (yet, or any more): never trained on as current
            self.counters["future_rollouts"] += 1
            return "future"
        if failed:
            self._finish_in_lease(g)
            self._drop([group_id], "failed_groups")
            return "failed"
        if sample_index in g.samples:
            self.counters["duplicates"] += 1
            return "duplicate"
        mv = g.version if min_version is None else min_version
        g.samples[sample_index] = Sample(frame, mv, reward, mv if max_version is None else max_version, filter_score)
        self.counters["accepted_rollouts"] += 1
        if len(g.samples) < self.cfg.n_samples_per_prompt:
            return "accepted"
        self._finish_in_lease(g)
        group = ReadyGroup(group_id, [g.samples[i] for i in sorted(g.samples)])
        if self._filters(group):
            self._drop([group_id], "filtered")  # its admission slot goes to a replacement prompt
            return "filtered"
        self._add_ready(group)
        return "complete"

    @property
    def filter_cap(self) -> int:
        """Groups dynamic sampling may filter per learner version (0: it is off)."""
        return self.cfg.dynamic_filtering_max_rounds * self.cfg.prompts_per_step if self.cfg.dynamic_filtering else 0

    def _filters(self, group: ReadyGroup) -> bool:
        """Dynamic sampling: is this complete group dropped for carrying no reward signal?"""
        if is_stale(group.min_version, self.version, self.cfg.max_staleness):
            return False  # dropped as stale anyway: it must not use up the cap
        verdict = filter_verdict([s.judged for s in group.samples], self.cfg.dynamic_filtering_range,
                                 self.filtered_now, self.filter_cap)
        if verdict == "keep":
            return False
        self.counters["no_signal_groups"] += 1  # counted with filtering off too: what it would filter
        if verdict == "capped":
            self.counters["unfiltered_past_cap"] += 1
            if self.cap_hit_at != self.version:
                self.cap_hit_at = self.version
                self.counters["filter_cap_hits"] += 1
                log.warning(cap_message(self.filtered_now, self.version, self.cfg.dynamic_filtering_max_rounds,
                                        self.cfg.prompts_per_step))
        self.filtered_now += verdict == "filter"
        return verdict == "filter"

    def _filtered_at(self, version: int) -> int:
        return sum(1 for c, v in self.dropped.values() if c == "filtered" and v == version)

    def _add_ready(self, group: ReadyGroup, restored: bool = False) -> None:
        if not restored:
            self.counters["accepted_groups"] += 1
            if self.store:
                self.store.group(group.group_id, [s.frame for s in group.samples])
        if is_stale(group.min_version, self.version, self.cfg.max_staleness):
            # too old for the step the learner is at, so for every step it will ask for
            self._drop([group.group_id], "dropped_stale")
            return
        self._queue(group)
        while len(self.ready) > self.cfg.max_queued_groups:
            self._drop([heapq.heappop(self.ready).group_id], "dropped_overflow")

    def set_version(self, version: int) -> None:
        if version <= self.version:
            return
        self.version = version
        self.filtered_now = 0
        if self.store:
            self.store.version(version)
        self._drop_stale()

    def _drop_stale(self) -> None:
        # Drop what is now too old as soon as the version moves, not when a batch is assembled:
        # each drop frees an admission slot for a fresh group.
        floor = self.version - self.cfg.max_staleness
        if self.oldest_ready >= floor:
            return
        stale = [g for g in self.ready if g.min_version < floor]
        if stale:
            self.ready = [g for g in self.ready if g.min_version >= floor]
            heapq.heapify(self.ready)
            self._drop([g.group_id for g in stale], "dropped_stale")
        self.oldest_ready = min((g.min_version for g in self.ready), default=math.inf)

    def _queue(self, group: ReadyGroup) -> None:
        heapq.heappush(self.ready, group)
        self.oldest_ready = min(self.oldest_ready, group.min_version)

    # ---- resume ----------------------------------------------------------------------------

    def resume(self, step: int, trained: set[int]) -> dict[str, int]:
        """Continue from the learner's checkpoint at `step`, whose lineage trained the groups `trained`.

        Afterwards the buffer is what an uninterrupted run would hold at version `step`, but for
        the work it redoes: every group neither trained nor finally dropped is ready (when its
        tokens all come from versions <= step) or issued again (served in a step the learner
        redoes, leased, queued with newer tokens, or dropped as stale at a later version).
        Returns the counts of what moved.
        """
        if not self.awaiting_resume and step == self.version and self.next_step <= step:
            return {"reissued": 0, "kept_ready": len(self.ready), "trained": len(trained), "noop": 1}
        ready = {g.group_id: g for g in self.ready}
        top = max(self.next_group, max(trained, default=-1) + 1)  # the buffer's log may be behind the learner
        again, kept = [], []
        for gid in range(top):
            if gid in trained:
                self.dropped.pop(gid, None)  # the learner's word wins over a log that was behind
                continue
            g = ready.get(gid)
            if g is not None and g.max_version <= step:
                kept.append(g)
                continue
            if g is None and gid in self.dropped:
                counter, at = self.dropped[gid]
                if counter != "dropped_stale" or at <= step:
                    continue  # final: it would be dropped in this lineage too
                del self.dropped[gid]
            again.append(gid)
        self.leases.clear()
        self.expiries.clear()
        self.pending.clear()
        self.batches.clear()
        self.released_steps.clear()
        self.requeue = deque(again)  # oldest first
        self.ready = kept
        heapq.heapify(self.ready)
        self.oldest_ready = -math.inf  # (swept below)
        self.next_group = top
        self.next_step = step
        self.version = step
        self.filtered_now = self._filtered_at(step)
        self.awaiting_resume = False
        self._drop_stale()
        self.counters["resumes"] += 1
        self.counters["reissued_after_resume"] += len(again)
        if self.store:
            self.store.snapshot(self)
        return {"reissued": len(again), "kept_ready": len(self.ready), "trained": len(trained), "noop": 0}

    # ---- batches ---------------------------------------------------------------------------

    def batch(self, step: int, rank: int, world_size: int, now: float | None = None
              ) -> tuple[list[bytes], dict[str, float]] | Wait:
        """Rank `rank`'s share of step `step` as (frames, stats), or Wait; RequestError if it cannot be."""
        pps = self.cfg.prompts_per_step
        if self.awaiting_resume:
            raise RequestError("resume", "the buffer was restored from disk: the learner must send its resume "
                                         "handshake (the step it resumed from and the groups it trained) first")
        if rank >= world_size:
            raise RequestError("batch_request.rank", f"rank {rank} >= world_size {world_size}")
        if pps % world_size:
            raise RequestError("batch_request.world_size",
                               f"prompts_per_step={pps} is not divisible by world_size={world_size}")
        self.set_version(step)
        b = self.batches.get(step)
        if b is None:
            if step in self.released_steps:
                raise RequestError("batch_request.step", f"step {step} was served to every rank and released")
            if len(self.ready) < pps:
                if self.exhausted() and not self.pending:
                    filtered = self.counters["filtered"]
                    return Wait(f"no batch for step {step} can be formed: data exhausted with "
                                f"{len(self.ready)} of {pps} groups left"
                                + (f" ({filtered} filtered by dynamic sampling)" if filtered else ""),
                                BATCH_RETRY_S, done=True)
                return Wait(f"step {step}: " + describe_wait(self.metrics(now)), BATCH_RETRY_S)
            b = self._assemble(step, world_size)
        if world_size != b.world_size:
            raise RequestError("batch_request.world_size",
                               f"step {step} was assembled for world_size {b.world_size}, not {world_size}")
        if rank not in b.fetched:
            b.fetched.add(rank)
            if len(b.fetched) == b.world_size:
                self._fetched_by_all(b)
        return b.shares[rank], b.stats[rank]

    def _assemble(self, step: int, world_size: int) -> StepBatch:
        pps = self.cfg.prompts_per_step
        groups = [heapq.heappop(self.ready) for _ in range(pps)]  # oldest first; none stale (set_version)
        shares, stats = [], []
        for rank in range(world_size):
            lo, hi = share_bounds(pps, world_size, rank)
            shares.append([s.frame for g in groups[lo:hi] for s in g.samples])
            # run-wide numbers too: the learner logs a share's stats with its step's metrics
            stats.append({**share_stats(groups[lo:hi], step), "filtered": self.counters["filtered"],
                          "filter_pass_rate": self.filter_pass_rate()})
        self.last_staleness_mean = share_stats(groups, step)["staleness_mean"]
        b = StepBatch(step, world_size, shares, stats, [g.group_id for g in groups])
        self.batches[step] = b
        self.next_step = max(self.next_step, step + 1)
        self.counters["served_groups"] += pps
        self.counters["served_rollouts"] += sum(len(s) for s in shares)
        return b

    def _fetched_by_all(self, b: StepBatch) -> None:
        if self.store:
            self.store.served(b.step, b.group_ids)
            self.store.counters(self.counters)  # once a step: a killed buffer's counts lag a step at most
        done = sorted(s for s, x in self.batches.items() if len(x.fetched) == x.world_size)
        for s in done[:-KEEP_FETCHED_STEPS]:
            del self.batches[s]
            self.released_steps.add(s)

    # ---- metrics and persistence -----------------------------------------------------------

    def open_groups(self) -> list[int]:
        """Issued and neither ready, dropped nor served: what a restart must issue again."""
        held = {gid for b in self.batches.values() if len(b.fetched) < b.world_size for gid in b.group_ids}
        return sorted(set(self.requeue) | set(self.pending) | held)

    def filter_pass_rate(self) -> float:
        """Of the complete groups not dropped as stale, the share dynamic sampling kept (1.0 before any)."""
        kept, filtered = self.counters["accepted_groups"], self.counters["filtered"]
        return kept / (kept + filtered) if kept + filtered else 1.0

    def metrics(self, now: float | None = None) -> dict[str, float]:
        c = self.counters

        def since(t: float | None) -> float:
            return -1.0 if t is None or now is None else now - t

        m = {
            "buffer/version": self.version,
            "buffer/queued_groups": len(self.ready),
            "buffer/leased_groups": len(self.pending),
            "buffer/partial_groups": sum(1 for g in self.pending.values() if g.samples),
            "buffer/requeued_groups": len(self.requeue),
            "buffer/active_leases": len(self.leases),
            "buffer/issued_groups": self.next_group,
            "buffer/live_groups": self.k_live,
            "buffer/admission_limit": admission_limit(self.version, self.cfg.max_staleness,
                                                      self.cfg.prompts_per_step),
            "buffer/total_groups": self.order.total,
            "buffer/prompts_per_step": self.cfg.prompts_per_step,
            "buffer/lease_ttl_s": self.cfg.lease_ttl_s,
            "buffer/staleness_mean": self.last_staleness_mean,
            "buffer/awaiting_resume": float(self.awaiting_resume),
            "buffer/since_lease_request_s": since(self.last_lease_request),
            "buffer/since_scored_s": since(self.last_scored),
            "buffer/quietest_lease_s": max((since(x.renewed_at) for x in self.leases.values()), default=-1.0),
            "buffer/refused_old_weights_recent": float(0 <= since(self.last_old_weights) < QUIET_S),
            "buffer/dropped_groups": self.n_dropped,
            "buffer/filtered_this_version": self.filtered_now,
            "buffer/filter_cap": self.filter_cap,
            "buffer/filter_pass_rate": self.filter_pass_rate(),
        }
        for name in COUNTERS:
            m[f"buffer/{name}"] = c[name]
        for name, v in c.items():
            m.setdefault(f"buffer/{name}", v)
        return {k: float(v) for k, v in m.items()}

    def restore(self, saved, groups: dict[int, list[Sample]]) -> None:
        """Continue from `buffer.store.Restored` (`groups`: its accepted-but-unserved groups, read back):
        those queue again, the groups leased and never answered are issued again, no fresh id repeats.
        Nothing is leased or served until the learner's `resume` handshake says where it stands."""
        self.next_group = saved.next_group
        self.next_lease_id = saved.next_lease_id
        self.dropped = dict(saved.dropped)
        self.version = saved.version
        self.counters.update(saved.counters)
        for reason, n in Counter(c for c, _ in self.dropped.values()).items():
            # the log's last counters record may predate its last drops (a killed buffer): records win
            self.counters[reason] = max(self.counters[reason], n)
        self.filtered_now = self._filtered_at(self.version)
        if self.filtered_now >= self.filter_cap > 0:
            self.cap_hit_at = self.version  # already counted and said before the restart
        self.requeue.extend(saved.open_groups)
        for gid, samples in sorted(groups.items()):
            if gid not in self.dropped:
                self._queue(ReadyGroup(gid, samples))  # judged (stale or not) at `resume`
        self.awaiting_resume = True
