"""The replay buffer's bookkeeping: prompt order, admission control, leases, groups and batches.

No sockets and no decoding here: `buffer/service.py` turns messages into calls on `BufferState`
and its return values into replies. The rules that tests check against hand-worked values
(`admission_limit`, `is_stale`, `share_bounds`) are plain functions at the top.

Life of a prompt group k (counted from 0 over the whole run):

    issued (leased) ──all n samples in──> ready ──batch for a step──> served
        │   │                               │
        │   └─ lease expired: back to the front of the queue, issued again under a new lease
        └─ failed sample / GroupFailed: dropped          └─ too old for the step: dropped (stale)
"""

from __future__ import annotations

import heapq
import json
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from buffer.config import BufferConfig
from buffer.protocol import LeaseGrant, PromptGroup, Wait

LEASE_RETRY_S = 0.1  # what a generator is told to wait when admission or the data holds it back
BATCH_RETRY_S = 0.02  # a learner waiting for a batch polls faster: it is the critical path
KEEP_FETCHED_STEPS = 2  # batches kept after every rank fetched them, for a rank whose reply was lost


# --------------------------------------------------------------------------------------------
# the rules


def admission_limit(version: int, max_staleness: int, prompts_per_step: int) -> int:
    """Prompt groups that may be live (issued and not dropped) while the learner is at `version`.

    Steps `version .. version + max_staleness` are the ones a group leased now can end up in
    without being too old, and each takes `prompts_per_step` groups.
    """
    return (version + max_staleness + 1) * prompts_per_step


def admits(k_live: int, version: int, max_staleness: int, prompts_per_step: int) -> bool:
    """May one more new group be leased? `k_live` = groups issued so far minus groups dropped."""
    return k_live < admission_limit(version, max_staleness, prompts_per_step)


def is_stale(min_version: int, step: int, max_staleness: int) -> bool:
    """A group whose oldest token came from `min_version` may not train step `step`."""
    return min_version < step - max_staleness


def share_bounds(n_groups: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s whole groups in a step's batch of `n_groups` (divisible by world_size)."""
    per = n_groups // world_size
    return rank * per, (rank + 1) * per


# --------------------------------------------------------------------------------------------
# prompts


class PromptsError(ValueError):
    """The prompt dataset cannot be used; the message names the file and line."""


@dataclass
class Prompt:
    text: str
    label: str | None
    index: int  # row of the file (blank lines not counted)


def load_prompts(path: str) -> list[Prompt]:
    """JSONL rows with `prompt` (str) and optional `label` (str or number); other keys are ignored."""
    if not path:
        raise PromptsError("buffer.prompts is not set: give a JSONL file of {\"prompt\": ..., \"label\": ...}")
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise PromptsError(f"{path}: cannot open the prompt file ({e.strerror})") from None
    prompts = []
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptsError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise PromptsError(f"{where}: expected a JSON object, got {type(row).__name__}")
            text = row.get("prompt")
            if not isinstance(text, str):
                raise PromptsError(f"{where}: `prompt` must be a string, got {text!r}")
            label = row.get("label")
            if isinstance(label, (int, float)) and not isinstance(label, bool):
                label = str(label)
            if label is not None and not isinstance(label, str):
                raise PromptsError(f"{where}: `label` must be a string or a number, got {label!r}")
            prompts.append(Prompt(text, label, len(prompts)))
    if not prompts:
        raise PromptsError(f"{path}: no prompts in the file")
    return prompts


class PromptOrder:
    """Group k -> row of the dataset: epoch k // N, shuffled with `seed + epoch` (file order if seed is None)."""

    def __init__(self, n_prompts: int, seed: int | None, epochs: int):
        self.n = n_prompts
        self.seed = seed
        self.total = n_prompts * epochs  # groups in the whole run
        self._perms: dict[int, list[int]] = {}

    def row(self, k: int) -> int:
        epoch, i = divmod(k, self.n)
        if self.seed is None:
            return i
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(self.n))
            random.Random(self.seed + epoch).shuffle(perm)
            self._perms = {epoch: perm}  # groups are issued in order: one epoch's order is enough
        return perm[i]


# --------------------------------------------------------------------------------------------
# groups, leases, batches


@dataclass
class Sample:
    """An accepted scored rollout: its wire bytes (served as they came) and what batching needs."""

    frame: bytes
    min_version: int  # oldest token's policy version
    reward: float


@dataclass
class PendingGroup:
    group_id: int
    lease_id: int  # the group's current lease: results for any other lease are late
    version: int  # learner version at grant; stands in for the token versions of empty completions
    samples: dict[int, Sample] = field(default_factory=dict)


@dataclass
class ReadyGroup:
    group_id: int
    samples: list[Sample]  # by sample index
    min_version: int = field(init=False)  # oldest token of the group: what staleness is judged by

    def __post_init__(self) -> None:
        self.min_version = min(s.min_version for s in self.samples)

    def __lt__(self, other: "ReadyGroup") -> bool:  # heap order: oldest group first
        return self.group_id < other.group_id


@dataclass
class Lease:
    lease_id: int
    worker_id: str
    group_ids: set[int]  # still pending under this lease
    expires_at: float


@dataclass
class StepBatch:
    step: int
    world_size: int
    shares: list[list[bytes]]  # frames per rank
    stats: list[dict[str, float]]  # per rank
    group_ids: list[int]
    fetched: set[int] = field(default_factory=set)


class RequestError(Exception):
    """A request that is well-formed but cannot be served; becomes an `Error` reply naming `field`."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def share_stats(groups: list[ReadyGroup], step: int) -> dict[str, float]:
    """Staleness (versions behind `step`, per rollout) and reward of one rank's share."""
    samples = [s for g in groups for s in g.samples]
    stale = [step - s.min_version for s in samples]
    n = max(len(samples), 1)
    return {
        "staleness_min": float(min(stale, default=0)),
        "staleness_mean": sum(stale) / n,
        "staleness_max": float(max(stale, default=0)),
        "reward_mean": sum(s.reward for s in samples) / n,
        "groups": float(len(groups)),
        "rollouts": float(len(samples)),
    }


class BufferState:
    """Everything the buffer knows; the service calls one method per request."""

    def __init__(self, cfg: BufferConfig, prompts: list[Prompt], store=None):
        self.cfg = cfg
        self.prompts = prompts
        self.order = PromptOrder(len(prompts), cfg.shuffle_seed, cfg.max_epochs)
        self.store = store  # `buffer.store.StateStore` or None; told about every change worth keeping
        self.version = 0  # the learner's version: max of SetVersion and the steps asked for
        self.next_group = 0  # groups issued for the first time so far (the next fresh group id)
        self.n_dropped = 0  # groups dropped (stale, failed, overflow): they no longer count as live
        self.next_lease_id = 1
        self.requeue: deque[int] = deque()  # groups whose lease expired, issued again before new ones
        self.pending: dict[int, PendingGroup] = {}  # group id -> group leased and not complete
        self.leases: dict[int, Lease] = {}
        self.ready: list[ReadyGroup] = []  # heap, oldest group id first
        self.batches: dict[int, StepBatch] = {}  # step -> batch not yet released
        self.released_steps: set[int] = set()
        self.last_staleness_mean = 0.0
        self.counters: Counter[str] = Counter()

    # ---- leases ----------------------------------------------------------------------------

    @property
    def k_live(self) -> int:
        # Dropped groups are subtracted: the learner never trains on them, so if they still counted
        # the window would stay full of groups that will never arrive and the run would deadlock
        # (no lease admitted, no batch complete) after enough drops.
        return self.next_group - self.n_dropped

    def exhausted(self) -> bool:
        """Every group of every epoch issued, and none waiting to be issued again."""
        return self.next_group >= self.order.total and not self.requeue

    def lease(self, worker_id: str, max_groups: int, now: float) -> LeaseGrant | Wait:
        self.expire(now)
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
        self.leases[lease_id] = Lease(lease_id, worker_id, set(group_ids), now + self.cfg.lease_ttl_s)
        self.counters["leases"] += 1
        if self.store:
            self.store.lease(lease_id, group_ids)
        groups = []
        for gid in group_ids:
            p = self.prompts[self.order.row(gid)]
            groups.append(PromptGroup(gid, p.text, p.label, p.index))
        return LeaseGrant(lease_id, groups, self.cfg.n_samples_per_prompt, self.cfg.lease_ttl_s, self.version)

    def renew(self, lease_id: int, now: float) -> None:
        self.expire(now)
        lease = self.leases.get(lease_id)
        if lease is None:
            raise RequestError("lease_renew.lease_id", f"lease {lease_id} is not active (expired, answered or unknown)")
        lease.expires_at = now + self.cfg.lease_ttl_s

    def expire(self, now: float) -> list[int]:
        """Put the groups of expired leases back at the front of the queue; returns them."""
        back = []
        for lease in [x for x in self.leases.values() if x.expires_at <= now]:
            del self.leases[lease.lease_id]
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
        self.n_dropped += len(group_ids)
        self.counters[counter] += len(group_ids)
        if self.store:
            self.store.dropped(group_ids)

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
                   min_version: int | None, reward: float, frame: bytes) -> str:
        """One scored rollout; returns what became of it: accepted | complete | late | duplicate | failed."""
        g = self.pending.get(group_id)
        if g is None or g.lease_id != lease_id:
            self.counters["late"] += 1
            return "late"
        if failed:
            self._finish_in_lease(g)
            self._drop([group_id], "failed_groups")
            return "failed"
        if sample_index in g.samples:
            self.counters["duplicates"] += 1
            return "duplicate"
        g.samples[sample_index] = Sample(frame, g.version if min_version is None else min_version, reward)
        self.counters["accepted_rollouts"] += 1
        if len(g.samples) < self.cfg.n_samples_per_prompt:
            return "accepted"
        self._finish_in_lease(g)
        self._add_ready(ReadyGroup(group_id, [g.samples[i] for i in sorted(g.samples)]))
        return "complete"

    def _add_ready(self, group: ReadyGroup, restored: bool = False) -> None:
        if not restored:
            self.counters["accepted_groups"] += 1
            if self.store:
                self.store.group(group.group_id, [s.frame for s in group.samples])
        if is_stale(group.min_version, self.version, self.cfg.max_staleness):
            # too old for the step the learner is at, so for every step it will ask for
            self._drop([group.group_id], "dropped_stale")
            return
        heapq.heappush(self.ready, group)
        while len(self.ready) > self.cfg.max_queued_groups:
            self._drop([heapq.heappop(self.ready).group_id], "dropped_overflow")

    def set_version(self, version: int) -> None:
        if version <= self.version:
            return
        self.version = version
        if self.store:
            self.store.version(version)
        # Drop what is now too old as soon as the version moves, not when a batch is assembled:
        # each drop frees an admission slot for a fresh group.
        floor = version - self.cfg.max_staleness
        stale = [g for g in self.ready if g.min_version < floor]
        if stale:
            self.ready = [g for g in self.ready if g.min_version >= floor]
            heapq.heapify(self.ready)
            self._drop([g.group_id for g in stale], "dropped_stale")

    # ---- batches ---------------------------------------------------------------------------

    def batch(self, step: int, rank: int, world_size: int) -> tuple[list[bytes], dict[str, float]] | Wait:
        """Rank `rank`'s share of step `step` as (frames, stats), or Wait; RequestError if it cannot be."""
        pps = self.cfg.prompts_per_step
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
                    return Wait(f"no batch for step {step} can be formed: data exhausted with "
                                f"{len(self.ready)} of {pps} groups left", BATCH_RETRY_S, done=True)
                return Wait(f"step {step}: {len(self.ready)} of {pps} groups ready, "
                            f"{len(self.pending)} leased", BATCH_RETRY_S)
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
            stats.append(share_stats(groups[lo:hi], step))
        self.last_staleness_mean = share_stats(groups, step)["staleness_mean"]
        b = StepBatch(step, world_size, shares, stats, [g.group_id for g in groups])
        self.batches[step] = b
        self.counters["served_groups"] += pps
        self.counters["served_rollouts"] += sum(len(s) for s in shares)
        return b

    def _fetched_by_all(self, b: StepBatch) -> None:
        if self.store:
            self.store.served(b.group_ids)
        done = sorted(s for s, x in self.batches.items() if len(x.fetched) == x.world_size)
        for s in done[:-KEEP_FETCHED_STEPS]:
            del self.batches[s]
            self.released_steps.add(s)

    # ---- metrics and persistence -----------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        c = self.counters
        m = {
            "buffer/version": self.version,
            "buffer/queued_groups": len(self.ready),
            "buffer/leased_groups": len(self.pending),
            "buffer/requeued_groups": len(self.requeue),
            "buffer/active_leases": len(self.leases),
            "buffer/issued_groups": self.next_group,
            "buffer/live_groups": self.k_live,
            "buffer/admission_limit": admission_limit(self.version, self.cfg.max_staleness,
                                                      self.cfg.prompts_per_step),
            "buffer/total_groups": self.order.total,
            "buffer/staleness_mean": self.last_staleness_mean,
        }
        for name in ("accepted_groups", "accepted_rollouts", "dropped_stale", "dropped_overflow",
                     "failed_groups", "late", "duplicates", "malformed", "reissued", "expired_leases",
                     "leases", "served_groups", "served_rollouts", "relayed", "internal_errors"):
            m[f"buffer/{name}"] = c[name]
        for name, v in c.items():
            m.setdefault(f"buffer/{name}", v)
        return {k: float(v) for k, v in m.items()}

    def restore(self, saved, groups: dict[int, list[Sample]]) -> None:
        """Continue from `buffer.store.Restored` (`groups`: its accepted-but-unserved groups, read back):
        those queue again, the groups leased and never answered are issued again, no fresh id repeats."""
        self.next_group = saved.next_group
        self.next_lease_id = saved.next_lease_id
        self.n_dropped = saved.n_dropped
        self.version = saved.version
        self.counters.update(saved.counters)
        self.requeue.extend(saved.open_groups)
        for gid, samples in sorted(groups.items()):
            self._add_ready(ReadyGroup(gid, samples), restored=True)
