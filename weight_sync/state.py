"""The weight-sync service's state: who holds which version, and who joins the next round.

The service never moves weights and never waits on anyone: every request is answered at once
from the state below, so a dead or slow generator cannot stall it. This is bookkeeping alone (no
sockets: `weight_sync/service.py` is the loop that feeds it the requests), one call per request.

A publish round (learner rank 0 sends `ready` for version N):
  members = every registered generator that is alive (not dropped by a round, heard from within
  `stale_after_s`); ranks are assigned in order, the sender being rank 0; the reply `go` lists
  them, and each member's next `poll` returns its `RoundInfo`. Unclaimed catch-up rounds of the
  previous version are cancelled (listed in `go.cancelled` so the sender releases their members).

A catch-up round (a generator polls while behind the current version):
  disk backend: the round points at the latest folder, answered on the spot;
  group backends: the generator is added to the forming catch-up round and gets its `RoundInfo` at
  once; the sender claims the round at its next `pending_request` and broadcasts its retained
  weights. Offered only while the sender is known to be serving (it promised, in its last
  `pending_request`, to ask again within `next_within_s`), so a behind generator never waits on a
  sender that is gone; otherwise it simply joins the next publish.

A generator's version is what it reports in `done` (after loading). The sender's `round_result`
names members that failed mid-round (`dead`) and members that never joined (`absent`: busy or
gone); both are left out of later publish rounds until they are heard from again, so a generator
that died between rounds costs one join window, not one per round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from weight_sync.config import WeightSyncConfig
from weight_sync.messages import (
    Ack,
    Done,
    Error,
    Go,
    Idle,
    Member,
    Offer,
    PendingRequest,
    Poll,
    Ready,
    Register,
    Registered,
    RoundInfo,
    RoundResult,
    Status,
    StatusRequest,
    Unregister,
    short,
)


@dataclass
class Generator:
    worker_id: str
    engine_kind: str
    world_size: int
    version: int
    last_seen: float
    dead: bool = False  # dropped by a round; revived by its next poll
    absent: bool = False  # missed a round's join window (busy or gone); back at its next message
    offer: RoundInfo | None = None  # a round not yet handed out
    round_id: int | None = None  # the round it was handed (until it polls again or reports done)
    load_s: float = 0.0


@dataclass
class Round:
    round_id: int
    version: int
    catch_up: bool
    members: dict[str, int] = field(default_factory=dict)  # worker id -> first rank
    next_rank: int = 1
    state: str = "forming"  # forming (catch-up, unclaimed) | running | closed
    created: float = 0.0
    unclaimed: int = 0  # a publish round's offers not yet picked up by their generators' polls


class SyncState:
    """The service's state and its answer to each message (no sockets: easy to test)."""

    def __init__(self, cfg: WeightSyncConfig, clock=time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.generators: dict[str, Generator] = {}
        self.rounds: dict[int, Round] = {}
        self.current: Ready | None = None
        self.forming: Round | None = None  # the open catch-up round
        self.sender_serving_until = 0.0
        self.next_round_id = 1
        self.last_round: dict = {}
        self.last_fanout: dict = {}  # the latest publish round whose every offer was picked up, and how fast
        self.counts = {"rounds": 0, "catch_up_rounds": 0, "errors": 0, "dropped": 0}
        self._handlers = {Register: self.on_register, Poll: self.on_poll, Done: self.on_done,
                          Unregister: self.on_unregister, Ready: self.on_ready, PendingRequest: self.on_pending,
                          RoundResult: self.on_round_result, StatusRequest: lambda _: Status(self.status())}

    @property
    def current_version(self) -> int:
        return self.current.version if self.current else -1

    # ---- dispatch --------------------------------------------------------------------------

    def handle(self, msg):
        """The reply to one request (a reply type sent as a request is refused)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            return Error(f"{type(msg).__name__} is a reply, not a request", "envelope.type")
        return handler(msg)

    # ---- generators ------------------------------------------------------------------------

    def on_unregister(self, m: Unregister) -> Ack:
        self.generators.pop(m.worker_id, None)
        return Ack("unregistered")

    def on_register(self, m: Register):
        g = self.generators.get(m.worker_id)
        if g is None or g.engine_kind != m.engine_kind or g.world_size != m.world_size:
            g = self.generators[m.worker_id] = Generator(m.worker_id, m.engine_kind, m.world_size, m.version,
                                                         self.clock())
        else:  # the same generator again (its client reconnected): keep what we know
            g.last_seen, g.dead, g.absent, g.version = self.clock(), False, False, m.version
        return Registered(self.current_version, self.cfg.mode)

    def _known(self, worker_id: str, where: str) -> Generator | Error:
        g = self.generators.get(worker_id)
        if g is None:
            return Error(f"unknown worker {short(worker_id)}: register first", f"{where}.worker_id")
        g.last_seen = self.clock()
        g.dead = g.absent = False
        return g

    def on_poll(self, m: Poll):
        g = self._known(m.worker_id, "poll")
        if isinstance(g, Error):
            return g
        g.version = m.version
        if g.offer is not None:
            info, g.offer = g.offer, None
            self._claimed(info.round_id)
            return Offer(info)
        if g.round_id is not None:  # polling again: it is done with the round it was handed
            self._leave(g)
        cur = self.current
        if cur is not None and g.version < cur.version and self.cfg.catch_up:
            info = self._catch_up(g)
            if info is not None:
                return Offer(info)
        return Idle(self.current_version, 0.5)

    def on_done(self, m: Done):
        g = self._known(m.worker_id, "done")
        if isinstance(g, Error):
            return g
        if m.ok:
            g.version = max(g.version, m.version)
            g.load_s = m.load_s
            if self.last_round.get("version") == m.version:
                self.last_round["load_s_max"] = max(self.last_round.get("load_s_max", 0.0), m.load_s)
        self._leave(g)
        return Ack(f"{m.worker_id} at v{g.version}")

    def _leave(self, g: Generator) -> None:
        r = self.rounds.get(g.round_id) if g.round_id is not None else None
        if r is not None and r.state == "forming":
            r.members.pop(g.worker_id, None)
        g.round_id = None

    # ---- rounds ----------------------------------------------------------------------------

    def _new_round(self, version: int, catch_up: bool) -> Round:
        r = Round(self.next_round_id, version, catch_up, created=self.clock())
        self.next_round_id += 1
        self.rounds[r.round_id] = r
        # closed rounds are only kept for a while (status, late messages)
        for rid in [rid for rid, old in self.rounds.items() if old.state == "closed"][:-16]:
            del self.rounds[rid]
        return r

    def _add(self, r: Round, g: Generator) -> RoundInfo:
        """Make `g` a member of `r`; its view of the round."""
        cur = self.current
        r.members[g.worker_id] = r.next_rank
        info = RoundInfo(r.round_id, r.version, cur.backend, self.cfg.mode, cur.timeout_s, r.catch_up, cur.manifest,
                         bucket_bytes=max(cur.manifest.buckets, default=0), host=cur.host, port=cur.port,
                         path=cur.path, rank=r.next_rank, local_world_size=g.world_size,
                         world_size=r.next_rank + g.world_size, adapter=cur.adapter, shm=cur.shm,
                         secret=cur.secret)
        r.next_rank += g.world_size
        g.round_id = r.round_id
        return info

    def _eligible(self, g: Generator) -> bool:
        return not g.dead and not g.absent and self.clock() - g.last_seen <= self.cfg.stale_after_s

    def on_ready(self, m: Ready):
        if self.current is not None and m.version < self.current.version:
            return Error(f"version {m.version} is older than the current {self.current.version}", "ready.version")
        self.current = m
        cancelled = []
        if self.forming is not None:  # its members wait for the old version: release them
            cancelled.append(self.forming.round_id)
            for wid in self.forming.members:
                if wid in self.generators:
                    self.generators[wid].round_id = None
            self.forming.state = "closed"
            self.forming = None
        r = self._new_round(m.version, catch_up=False)
        r.state = "running"
        for g in self.generators.values():
            if self._eligible(g):
                g.offer = self._add(r, g)  # replaces any older offer never picked up
        r.unclaimed = len(r.members)
        self.counts["rounds"] += 1
        members = [Member(wid, rank, self.generators[wid].world_size) for wid, rank in r.members.items()]
        if m.backend == "disk":  # nothing to coordinate: members read the folder at their next poll
            r.state = "closed"
            self.last_round = {"round_id": r.round_id, "version": m.version, "backend": "disk",
                               "members": [x.worker_id for x in members], "path": m.path}
        return Go(r.round_id, m.version, members, r.next_rank, False, cancelled)

    def _claimed(self, round_id: int) -> None:
        """One offer of publish round `round_id` picked up; the last one gives the round's fan-out
        (from `ready` to every member holding its offer: what polling costs a publish)."""
        r = self.rounds.get(round_id)
        if r is None or r.unclaimed <= 0:
            return
        r.unclaimed -= 1
        if not r.unclaimed:
            self.last_fanout = {"round_id": r.round_id, "version": r.version, "members": len(r.members),
                                "fanout_s": round(self.clock() - r.created, 4)}

    def _catch_up(self, g: Generator) -> RoundInfo | None:
        cur = self.current
        if cur.backend == "disk":
            r = self._new_round(cur.version, catch_up=True)
            info = self._add(r, g)
            r.state = "closed"  # nothing to coordinate: the generator reads the folder
            self.counts["catch_up_rounds"] += 1
            return info
        if not cur.can_catch_up or self.clock() > self.sender_serving_until:
            return None
        if self.forming is None:
            self.forming = self._new_round(cur.version, catch_up=True)
        return self._add(self.forming, g)

    def on_pending(self, m: PendingRequest):
        cur = self.current
        if cur is None or m.sender_id != cur.sender_id or m.version != cur.version:
            return Idle(self.current_version, 0.5)
        self.sender_serving_until = self.clock() + m.next_within_s
        r = self.forming
        if r is None or not r.members:
            return Idle(self.current_version, 0.5)
        self.forming = None
        r.state = "running"
        self.counts["catch_up_rounds"] += 1
        members = [Member(wid, rank, self.generators[wid].world_size) for wid, rank in r.members.items()
                   if wid in self.generators]
        return Go(r.round_id, r.version, members, r.next_rank, True, [])

    def on_round_result(self, m: RoundResult):
        r = self.rounds.get(m.round_id)
        if r is not None:
            r.state = "closed"
        for wid in m.failed:
            g = self.generators.get(wid)
            if g is not None:
                g.dead = True
                g.round_id = None
                self.counts["dropped"] += 1
        for wid in m.missed:
            g = self.generators.get(wid)
            if g is not None and g.round_id == m.round_id:
                g.round_id = None
                # a generator gone before joining must not cost every later publish a join window:
                # left out until it is heard from again (a busy one then catches up at its next poll)
                g.absent = True
                if g.offer is not None and g.offer.round_id == m.round_id:
                    g.offer = None  # never picked up: its next poll gets a catch-up instead
                    if r is not None:
                        r.unclaimed -= 1
        self.last_round = {"round_id": m.round_id, "version": m.version, "ok": list(m.ok), "missed": list(m.missed),
                           "failed": list(m.failed), **msgspec.structs.asdict(m.stats)}
        return Ack(f"round {m.round_id} closed")

    # ---- status ----------------------------------------------------------------------------

    def status(self) -> dict:
        now = self.clock()
        cur = self.current_version
        gens = {}
        for g in self.generators.values():
            gens[g.worker_id] = {
                "engine_kind": g.engine_kind, "world_size": g.world_size, "version": g.version,
                "lag": (cur - g.version) if cur >= 0 else 0, "dead": g.dead, "absent": g.absent,
                "last_seen_s": round(now - g.last_seen, 3), "load_s": g.load_s,
            }
        lags = [v["lag"] for v in gens.values() if not v["dead"]]
        return {
            "current_version": cur,
            "backend": self.current.backend if self.current else "",
            "generators": gens,
            "max_lag": max(lags, default=0),
            "last_round": dict(self.last_round),
            "last_fanout": dict(self.last_fanout),
            **self.counts,
        }
