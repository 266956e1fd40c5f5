"""The replay buffer service: one thread, one `zmq.Poller`, four sockets.

    control   ROUTER  requests from generators, scorers and learner ranks (DEALERs); one reply each
    ingest    PULL    scored rollouts from scorers (`scored` messages)
    relay_in  PULL    raw rollouts from generators (`rollouts` messages) ...
    relay_out PUSH    ... forwarded, envelope checked, to whichever scorer is free

`BufferService.run` is the loop; `buffer/state.py` holds the bookkeeping it drives (admission, leases, groups,
batches) and `buffer/store.py` what it keeps on disk. A scored rollout is checked once, by its type, as a learner will
decode it (`scored_meta`: `protocol.check_scored` accepts and refuses what `decode_item` does, without building the
arrays the buffer never reads); its frame is kept as received (the `zmq.Frame` itself: nothing is copied out of it)
and served to the learner as it came (`protocol.encode_batch`), never encoded again. Relayed messages go on as
received too, and every socket is read and written part by part without copies (`common.channel.recv_frames`,
`send_frames`).

Nothing a peer sends can stop the loop: a malformed request gets an `Error` reply naming the field, a malformed stream
message is dropped and counted (`buffer/malformed`), an unexpected exception in any socket's handler is counted
(`buffer/internal_errors`) and the loop goes on; warnings are rate-limited. A full disk (`common.disk.OutOfDisk`) does
stop it, before it answers the request whose record its state log could not take. Nor can a peer make the buffer hold
memory without bound: every socket caps a frame (MAXMSGSIZE) and what it queues per peer (high-water marks, in
messages), and `MemoryGuard` covers what libzmq cannot bound (a multipart message that never ends).
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from typing import NamedTuple, Sequence

import zmq

from buffer.access import SOCKET_ROLES, Gate, refused_peers
from buffer.config import BufferConfig, EvalConfig, endpoints
from buffer.eval import Evaluator, eval_prompts
from buffer.groups import RequestError, Sample
from buffer.messages import (
    DEFAULT_LIMITS,
    TYPE_NAMES,
    Ack,
    BatchRequest,
    Error,
    EvalRequest,
    GroupFailed,
    LeaseRenew,
    LeaseRequest,
    Limits,
    Metrics,
    MetricsRequest,
    ProtocolError,
    Resume,
    SetVersion,
    Wait,
    check_scored,
    decode,
    decode_envelope,
    decode_item,
    encode,
    encode_batch,
    short,
)
from buffer.prompts import prompts_from_config
from buffer.rules import filter_score
from buffer.state import BufferState
from buffer.store import StateStore
from common.channel import recv_frames, send_frames, send_reply
from common.disk import OutOfDisk
from common.guards import MemoryGuard, WarnLimiter, raise_open_files_limit, rss_bytes
from common.ready import mark_ready
from common.zap import Guard, server_guard

log = logging.getLogger("buffer")

POLL_MS = 50  # the longest the loop sleeps: bounds how late a lease expires or SIGTERM is seen
DRAIN = 64  # messages taken from one socket before looking at the others again
EXPIRE_EVERY_S = 0.05
# Types a peer may receive from the buffer but never send it as a request.
NOT_REQUESTS = {"lease_grant", "wait", "metrics", "eval_report", "ack", "error", "batch", "rollouts"}
assert NOT_REQUESTS <= TYPE_NAMES
# What each socket queues per peer, in whole messages (libzmq counts messages, not bytes; MAXMSGSIZE bounds each
# frame). A client has one request in flight, so 16 unread replies on control are already a misbehaving peer (a ROUTER
# drops replies past it). relay_out holds few per scorer: a peer that stops reading (or never was a scorer) strands at
# most that many, which go back to the queue when their leases expire.
RCVHWM = {"control": 16, "ingest": 32, "relay_in": 32, "relay_out": 1}
SNDHWM = {"control": 16, "ingest": 1, "relay_in": 1, "relay_out": 4}


class ResumeError(RuntimeError):
    """`--resume` was asked for but there is no state to resume from."""


class ScoredMeta(NamedTuple):
    """What the bookkeeping reads of one scored rollout (the frame itself is kept as it came)."""

    group_id: int
    sample_index: int
    lease_id: int
    failed: bool
    min_version: int | None  # oldest token's policy version; None for an empty completion
    reward: float
    error: str
    max_version: int | None = None  # newest token's policy version; None for an empty completion
    filter_score: float | None = None  # what dynamic sampling judges instead of the reward (rules.filter_score)


def scored_meta(frame: bytes, where: str, limits: Limits = DEFAULT_LIMITS) -> ScoredMeta:
    """The bookkeeping fields of a valid scored-rollout frame (checked whole by its type, as a learner
    will decode it, but for building its arrays); `ProtocolError` naming the field for an invalid one."""
    s = check_scored(frame, where, limits)
    r, (lo, hi) = s.rollout, s.rollout.version_range() or (None, None)
    return ScoredMeta(r.group_id, r.sample_index, r.lease_id, s.failed, lo, s.reward, s.error, hi,
                      filter_score(s.metadata))


class BufferService:
    def __init__(self, cfg: BufferConfig, resume: bool = False, eval_cfg: EvalConfig | None = None):
        self.cfg = cfg
        self.limits = DEFAULT_LIMITS
        self.warnings = WarnLimiter(log)
        self.stopping = threading.Event()  # set by SIGTERM/SIGINT, or `run`'s caller's `stop`
        self.ctx = zmq.Context()
        # CurveZMQ: who may connect, and what each may ask (buffer/access.py); None on trusted loopback
        self.guard = server_guard(cfg.curve, cfg.host, self.ctx, "buffer")
        prompts = prompts_from_config(cfg)
        self.store = StateStore(cfg.state_dir, cfg.fsync, int(cfg.compact_mb * 1e6)) if cfg.state_dir else None
        if resume and not (self.store and self.store.exists()):
            where = f"{cfg.state_dir}/" if cfg.state_dir else "(buffer.state_dir is not set)"
            raise ResumeError(f"--resume: no saved buffer state in {where}")
        self.state = BufferState(cfg, prompts, self.store)
        self.evals = None  # evaluation during training (buffer/eval.py), when there is a dataset
        if eval_cfg is not None and eval_cfg.dataset:
            self.evals = Evaluator(eval_cfg, eval_prompts(eval_cfg, cfg), cfg.lease_ttl_s)
        if self.store:
            self.store.lock()
            saved = self.store.load() if self.store.exists() else None
            self.store.open()
            if saved is not None:
                self._restore(saved)

        self.endpoints = endpoints(cfg.host, cfg.port)
        self.gate = Gate(self._lease_live, self.state.counters) if self.guard else None
        self._open_sockets()
        self._relay_pending: list | None = None  # a message relay_out could not take yet
        self.memory: MemoryGuard | None = None  # set by `run` when the buffer is a process of its own
        self._next_expiry = 0.0
        self._next_summary = time.monotonic() + cfg.log_interval_s
        self._summary_rollouts = 0

    def _open_sockets(self, tries: int = 1) -> None:
        self.control = self._bind(zmq.ROUTER, "control", tries)
        self.ingest = self._bind(zmq.PULL, "ingest", tries)
        self.relay_in = self._bind(zmq.PULL, "relay_in", tries)
        self.relay_out = self._bind(zmq.PUSH, "relay_out", tries)
        self.poller = zmq.Poller()
        for s in (self.control, self.ingest, self.relay_in):
            self.poller.register(s, zmq.POLLIN)
        self._relay_polled = None

    def _bind(self, kind: int, name: str, tries: int = 1) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        # a peer sending a bigger frame is disconnected before it fills our memory (any socket reads, even a PUSH)
        s.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
        s.setsockopt(zmq.RCVHWM, RCVHWM[name])
        s.setsockopt(zmq.SNDHWM, SNDHWM[name])
        if kind == zmq.ROUTER:
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue is said, not silent (send_reply)
        if kind == zmq.PUSH:
            s.setsockopt(zmq.IMMEDIATE, 1)  # queue only to peers whose connection is complete
        if self.guard is not None:
            self.guard.secure(s, name, SOCKET_ROLES[name])
        for attempt in range(tries):  # (binding again: the old listener may take a moment to go)
            try:
                s.bind(self.endpoints[name])
                return s
            except zmq.ZMQError as e:
                if attempt + 1 == tries:
                    s.close()
                    self.close_sockets()
                    raise OSError(f"buffer cannot bind {name} socket to {self.endpoints[name]}: {e}") from None
                time.sleep(0.05)

    def _reset_sockets(self) -> None:
        """Drop every connection (see `MemoryGuard`): close the sockets and bind them again."""
        self.state.counters["memory_resets"] += 1
        log.warning("the buffer grew %d MB since it started and holds %d MB of rollouts (a peer sending a "
                    "message that never ends?): dropping every connection; peers reconnect, and what they "
                    "had in flight is lost", (rss_bytes() - self.memory.base) >> 20, self._held_bytes() >> 20)
        self.close_sockets()
        self._open_sockets(tries=100)
        self.memory.reset()

    def _held_bytes(self) -> int:
        """Bytes of rollouts the bookkeeping keeps (what the buffer is meant to hold)."""
        st = self.state
        n = sum(len(x.frame) for g in st.pending.values() for x in g.samples.values())
        n += sum(len(x.frame) for g in st.ready for x in g.samples)
        n += sum(len(f) for b in st.batches.values() for share in b.shares for f in share)
        return n + sum(map(len, self._relay_pending or ()))

    def _restore(self, saved) -> None:
        groups = {}
        for gid, frames in saved.groups.items():
            try:
                metas = [scored_meta(f, f"state group {gid}", self.limits) for f in frames]
                groups[gid] = [Sample(f, saved.version if m.min_version is None else m.min_version, m.reward,
                                      -1 if m.max_version is None else m.max_version, m.filter_score)
                               for m, f in zip(metas, frames)]
            except ProtocolError as e:
                log.warning("state: group %d cannot be read back (%s); dropping it", gid, e)
        self.state.restore(saved, groups)
        log.info("restored from %s: version %d, %d groups issued, %d accepted and unserved, %d to issue again; "
                 "nothing is leased or served until the learner's resume handshake", self.store.path,
                 saved.version, saved.next_group, len(self.state.ready), len(saved.open_groups))

    # ---- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until `stop` is set, or without it until SIGTERM/SIGINT: wait on the sockets, handle
        what came, expire leases, log."""
        if stop is not None:
            self.stopping = stop
        if threading.current_thread() is threading.main_thread():  # (a test may run it in a thread)
            if stop is None:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, self._on_signal)
            # two of the biggest messages may be on their way in at once; past that, see MemoryGuard
            self.memory = MemoryGuard(2 * self.limits.max_message_bytes)
            # what exists now (modules, config, the prompts) lives as long as the process: left out of
            # the collector's passes, each pass costs what the rollouts in flight cost, not the dataset
            gc.freeze()
        print("buffer ready " + " ".join(f"{k}={v}" for k, v in self.endpoints.items()), flush=True)
        mark_ready("buffer", **self.endpoints)
        log.info("serving %d prompts x %d epochs, %d groups of %d per step, max_staleness %d%s",
                 self.state.order.n, self.cfg.max_epochs, self.cfg.prompts_per_step,
                 self.cfg.n_samples_per_prompt, self.cfg.max_staleness,
                 f", dynamic sampling (at most {self.state.filter_cap} groups filtered per step)"
                 if self.cfg.dynamic_filtering else "")
        while not self.stopping.is_set():
            self._poll_relay_when_it_can_move()
            events = dict(self.poller.poll(POLL_MS))
            if self.control in events:
                self._drain(self.control, self.on_control)
            if self.ingest in events:
                self._drain(self.ingest, self.on_ingest)
            if self.relay_in in events or self.relay_out in events:
                self._guarded(self.forward_relay)
            now = time.monotonic()
            if self.memory is not None and self.memory.over(now, self._held_bytes):
                self._reset_sockets()
            if now >= self._next_expiry:
                if self.evals:
                    self.evals.expire(now)
                back = self.state.expire(now)
                if back:
                    log.info("leases expired: %d groups go back to the queue (%s)", len(back), _ids(back))
                self._next_expiry = now + EXPIRE_EVERY_S
            if now >= self._next_summary:
                self.summary(now)
            if self.store:
                self.store.flush()
                self.store.maybe_compact(self.state)
        self.shutdown()

    def _on_signal(self, signum, frame) -> None:
        log.info("signal %d: stopping", signum)
        self.stopping.set()

    def _drain(self, sock: zmq.Socket, handle) -> None:
        for _ in range(DRAIN):
            try:
                frames = recv_frames(sock, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._guarded(handle, frames)

    def _guarded(self, handle, *args) -> None:
        try:
            handle(*args)
        except OutOfDisk:  # what the state log cannot hold must not be answered: the buffer stops
            raise
        except Exception:  # a bug must not take the buffer (and every accepted rollout) down
            self.state.counters["internal_errors"] += 1
            self.warnings.warn("internal", "internal error while handling a message; carrying on", exc_info=True)

    # ---- control: one request, one reply ---------------------------------------------------

    def on_control(self, frames: list[zmq.Frame]) -> None:
        self.state.counters["requests"] += 1
        identity = frames[0]
        if len(frames) < 3 or len(frames[1]):
            # a DEALER must send [b"", *message], like a REQ socket does
            self._malformed("control", ProtocolError("message", "expected an empty delimiter frame then the message"))
            reply = encode(Error("message: expected an empty delimiter frame then the message", "message"))
        else:
            try:
                reply = self.handle_request(frames[2:], Guard.who(frames[-1]) if self.guard else None)
            except ProtocolError as e:
                self._malformed("control", e)
                reply = encode(Error(str(e), e.field))
            except RequestError as e:
                reply = encode(Error(e.message, e.field))
            except OutOfDisk:  # its record is not in the log: no reply (see _guarded)
                raise
            except Exception as e:
                self.state.counters["internal_errors"] += 1
                self.warnings.warn("internal", "internal error while serving a request", exc_info=True)
                reply = encode(Error(f"internal error in the buffer: {type(e).__name__}: {str(e)[:200]}"))
        if not send_reply(self.control, [identity, b"", *reply]):  # a peer gone, or one that does not read
            self.state.counters["replies_dropped"] += 1

    def handle_request(self, body: Sequence, who: str | None = None) -> list:
        """The reply frames to one request (the frames after the delimiter) from the key named `who`
        (None: CURVE is off, nothing to check)."""
        now = time.monotonic()
        kind, _ = decode_envelope(body, self.limits)
        if kind == "scored":
            if self.gate:
                self.gate.check(kind, who)
            accepted, rejected = self.take_scored(body[1:])
            return encode(Ack(accepted, rejected, f"{accepted} accepted, {rejected} refused (late or duplicate)"))
        if kind in NOT_REQUESTS:
            raise ProtocolError("envelope.type", f"{short(kind)} is not a request the buffer serves on control")
        msg = decode(body, self.limits)
        if self.gate:
            self.gate.check(msg, who)
        if isinstance(msg, LeaseRequest):
            reply = self.evals and self.evals.lease(msg.max_groups, msg.version, now)  # (ahead of training)
            reply = reply or self.state.lease(msg.worker_id, msg.max_groups, now, msg.version)
            if isinstance(reply, Wait):
                log.debug("lease for %s: wait (%s)", msg.worker_id, reply.reason)
            else:
                log.debug("lease %d to %s: groups %s", reply.lease_id, msg.worker_id,
                          _ids([g.group_id for g in reply.groups]))
                if self.gate:
                    self.gate.granted(reply, who)
            return encode(reply)
        if isinstance(msg, LeaseRenew):
            if self.evals and self.evals.owns_lease(msg.lease_id):
                self.evals.renew(msg.lease_id, now)
            else:
                self.state.renew(msg.lease_id, now)
            return encode(Ack(1, 0, f"lease {msg.lease_id} renewed for {self.cfg.lease_ttl_s}s"))
        if isinstance(msg, GroupFailed):
            if self.evals and self.evals.owns_group(msg.group_id):
                ok = self.evals.group_failed(msg.lease_id, msg.group_id, msg.reason)
                return encode(Ack(int(ok), int(not ok), f"evaluation group {msg.group_id} given up" if ok else
                                  f"group {msg.group_id} is not pending under lease {msg.lease_id}"))
            if self.state.group_failed(msg.lease_id, msg.group_id):
                log.info("group %d given up under lease %d: %s", msg.group_id, msg.lease_id, msg.reason)
                return encode(Ack(1, 0, f"group {msg.group_id} dropped"))
            return encode(Ack(0, 1, f"group {msg.group_id} is not pending under lease {msg.lease_id}"))
        if isinstance(msg, BatchRequest):
            reply = self.state.batch(msg.step, msg.rank, msg.world_size, now)
            if isinstance(reply, Wait):
                return encode(reply)
            frames, stats = reply
            log.debug("batch step %d rank %d/%d: %d rollouts, staleness mean %.2f", msg.step, msg.rank,
                      msg.world_size, len(frames), stats["staleness_mean"])
            return encode_batch(msg.step, msg.rank, msg.world_size, frames, stats)
        if isinstance(msg, SetVersion):
            self.state.set_version(msg.version)
            return encode(Ack(1, 0, f"version {self.state.version}"))
        if isinstance(msg, Resume):
            was = self.state.version
            moved = self.state.resume(msg.step, set(msg.trained.tolist()))
            if not moved["noop"]:
                log.info("resume at step %d (the buffer was at version %d): %d groups trained by the learner's "
                         "lineage, %d accepted groups kept, %d issued again", msg.step, was, moved["trained"],
                         moved["kept_ready"], moved["reissued"])
            return encode(Ack(1, 0, f"resumed at step {msg.step}: {moved['reissued']} groups issued again"))
        if isinstance(msg, MetricsRequest):
            return encode(Metrics({**self.state.metrics(now), **(self.evals.metrics() if self.evals else {}),
                                   **refused_peers(self.guard)}))
        if isinstance(msg, EvalRequest):
            if self.evals is None:
                raise RequestError("eval_request", "this buffer has no evaluation dataset (eval.dataset)")
            return encode(self.evals.request(msg.version, now))
        raise ProtocolError("envelope.type", f"{type(msg).__name__} is not a request the buffer serves")

    def _lease_live(self, lease_id: int) -> bool:
        return lease_id in self.state.leases or bool(self.evals and self.evals.owns_lease(lease_id))

    # ---- scored rollouts -------------------------------------------------------------------

    def on_ingest(self, frames: list[zmq.Frame]) -> None:
        try:
            kind, _ = decode_envelope(frames, self.limits)
            if kind != "scored":
                raise ProtocolError("envelope.type", f"ingest takes `scored` messages, got {short(kind)}")
            self.take_scored(frames[1:])
        except ProtocolError as e:
            self._malformed("ingest", e)

    def take_scored(self, item_frames: Sequence) -> tuple[int, int]:
        """Check every item of a `scored` message, then hand them to the bookkeeping: a message is
        taken whole or refused whole (ProtocolError), so a bad item never leaves half a message in."""
        metas = []
        for i, f in enumerate(item_frames):
            m = scored_meta(f, f"scored[{i}]", self.limits)
            n = (self.evals.round_k if self.evals and self.evals.owns_group(m.group_id)
                 else self.cfg.n_samples_per_prompt)
            if m.sample_index >= n:
                raise ProtocolError(f"scored[{i}].rollout.sample_index",
                                    f"{m.sample_index} >= n_samples_per_prompt {n}")
            metas.append(m)
        accepted = 0
        now = time.monotonic()
        for m, f in zip(metas, item_frames):
            if self.evals and self.evals.owns_group(m.group_id):
                outcome = self.evals.add_sample(decode_item(f, "scored", limits=self.limits),
                                                (m.min_version, m.max_version))
                accepted += outcome in ("accepted", "complete", "failed")
                continue
            outcome = self.state.add_sample(m.group_id, m.sample_index, m.lease_id, m.failed, m.min_version,
                                            m.reward, f, m.max_version, now, m.filter_score)
            if outcome in ("accepted", "complete", "filtered"):
                accepted += 1
            if outcome == "filtered":
                log.debug("group %d filtered: its rewards carry no signal (dynamic sampling)", m.group_id)
            elif outcome == "failed":
                log.info("group %d dropped: sample %d failed scoring (%s)", m.group_id, m.sample_index, m.error[:200])
        self._summary_rollouts += accepted
        return accepted, len(metas) - accepted

    # ---- relay: generators -> scorers ------------------------------------------------------

    def _poll_relay_when_it_can_move(self) -> None:
        """Read relay_in only while relay_out can take a message: with no scorer (or slow ones) the
        generators' PUSH sockets fill up and block them, instead of this loop buffering without bound."""
        writable = self._relay_pending is None and bool(self.relay_out.getsockopt(zmq.EVENTS) & zmq.POLLOUT)
        if writable != self._relay_polled:
            self.poller.modify(self.relay_in, zmq.POLLIN if writable else 0)
            self.poller.modify(self.relay_out, 0 if writable else zmq.POLLOUT)
            self._relay_polled = writable

    def forward_relay(self) -> None:
        for _ in range(DRAIN):
            if self._relay_pending is None:
                try:
                    frames = recv_frames(self.relay_in, zmq.NOBLOCK)
                except zmq.Again:
                    return
                try:
                    kind, _ = decode_envelope(frames, self.limits)
                    if kind != "rollouts":
                        raise ProtocolError("envelope.type", f"the relay takes `rollouts` messages, got {short(kind)}")
                    if self.gate:
                        self.gate.check_relay(frames, Guard.who(frames[-1]))
                except ProtocolError as e:
                    self._malformed("relay", e)
                    continue
                except RequestError as e:
                    self.warnings.warn("relay_refused", "relayed rollouts dropped: %s", e.message)
                    continue
                self._relay_pending = frames
            try:
                send_frames(self.relay_out, self._relay_pending, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.state.counters["relayed"] += 1
            self.state.counters["relayed_rollouts"] += len(self._relay_pending) - 1
            self._relay_pending = None

    # ---- bookkeeping of the loop itself ----------------------------------------------------

    def _malformed(self, where: str, e: ProtocolError) -> None:
        self.state.counters["malformed"] += 1
        self.state.counters[f"malformed_{where}"] += 1
        self.warnings.warn(where, "malformed message on %s %s: %s", where,
                           "answered with an error" if where == "control" else "dropped", e)

    def summary(self, now: float) -> None:
        interval = self.cfg.log_interval_s + now - self._next_summary
        m = self.state.metrics(now)
        log.info("version %d | groups queued %d leased %d issued %d/%d | accepted %d served %d | dropped "
                 "stale %d failed %d overflow %d filtered %d | late %d malformed %d | %.0f rollouts/s in",
                 *(m[f"buffer/{k}"] for k in ("version", "queued_groups", "leased_groups", "issued_groups",
                                              "total_groups", "accepted_groups", "served_groups", "dropped_stale",
                                              "failed_groups", "dropped_overflow", "filtered", "late", "malformed")),
                 self._summary_rollouts / max(interval, 1e-9))
        self._summary_rollouts = 0
        self._next_summary = now + self.cfg.log_interval_s
        if self.store:
            self.store.counters(self.state.counters)

    def close_sockets(self) -> None:
        for name in ("control", "ingest", "relay_in", "relay_out"):
            s = getattr(self, name, None)
            if s is not None and not s.closed:
                s.close(0)

    def shutdown(self) -> None:
        self.close_sockets()
        if self.guard is not None:
            self.guard.close()
        self.ctx.term()
        if self.store:
            self.store.snapshot(self.state)
            self.store.close()
            log.info("state written to %s", self.store.path)
        log.info("stopped: %d groups accepted, %d served", self.state.counters["accepted_groups"],
                 self.state.counters["served_groups"])


def _ids(ids: list[int], shown: int = 8) -> str:
    return ", ".join(map(str, ids[:shown])) + (f" ... ({len(ids)} in all)" if len(ids) > shown else "")


def run(cfg: BufferConfig, stop: threading.Event | None = None, resume: bool = False,
        eval_cfg: EvalConfig | None = None) -> int:
    """Run a buffer until `stop` is set, or without it until SIGTERM/SIGINT; the exit code.

    `resume`: saved state in `buffer.state_dir` is required (ResumeError without it); `eval_cfg`:
    the run's `eval:` section, for evaluation during training."""
    raise_open_files_limit(log, per_peer=3)
    BufferService(cfg, resume, eval_cfg).run(stop)
    return 0
