"""The replay buffer service: one thread, one `zmq.Poller`, four sockets.

    control   ROUTER  requests from generators, scorers and learner ranks (DEALERs); one reply each
    ingest    PULL    scored rollouts from scorers (`scored` messages)
    relay_in  PULL    raw rollouts from generators (`rollouts` messages) ...
    relay_out PUSH    ... forwarded, envelope checked, to whichever scorer is free

`BufferService.run` is the loop; `buffer/state.py` holds the bookkeeping it drives (admission,
leases, groups, batches) and `buffer/store.py` what it keeps on disk. A scored rollout is checked
once (`buffer/ingest.py`: unpacked, every field checked, no objects built), its frame kept as
received and served to the learner as it came (`protocol.encode_batch`), never encoded again.

Nothing a peer sends can stop the loop: a malformed request gets an `Error` reply naming the field,
a malformed stream message is dropped and counted (`buffer/malformed`), warnings are rate-limited.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Sequence

import zmq

from buffer.config import BufferConfig, endpoints
from buffer.protocol import (
    DEFAULT_LIMITS,
    Ack,
    BatchRequest,
    Error,
    GroupFailed,
    LeaseRenew,
    LeaseRequest,
    Metrics,
    MetricsRequest,
    ProtocolError,
    Resume,
    SetVersion,
    Wait,
    decode,
    decode_envelope,
    encode,
    encode_batch,
)
from buffer.ingest import scored_meta
from buffer.state import BufferState, RequestError, Sample, load_prompts
from buffer.store import StateStore

log = logging.getLogger("buffer")

POLL_MS = 50  # the longest the loop sleeps: bounds how late a lease expires or SIGTERM is seen
DRAIN = 64  # messages taken from one socket before looking at the others again
EXPIRE_EVERY_S = 0.05
# Types a peer may receive from the buffer but never send it as a request.
NOT_REQUESTS = {"lease_grant", "wait", "metrics", "ack", "error", "batch", "rollouts"}


class ResumeError(RuntimeError):
    """`--resume` was asked for but there is no state to resume from."""


class WarnLimiter:
    """At most one warning per `every_s` per kind; says how many were held back."""

    def __init__(self, every_s: float = 5.0):
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        log.warning(msg + (f" ({held} more since the last warning of this kind)" if held else ""), *args)


class BufferService:
    def __init__(self, cfg: BufferConfig, resume: bool = False):
        self.cfg = cfg
        self.limits = DEFAULT_LIMITS
        self.warnings = WarnLimiter()
        self.stopping = False
        prompts = load_prompts(cfg.prompts)
        self.store = (StateStore(cfg.state_dir, cfg.fsync, int(cfg.compact_mb * 1e6))
                      if cfg.state_dir else None)
        if resume and not (self.store and self.store.exists()):
            where = f"{cfg.state_dir}/" if cfg.state_dir else "(buffer.state_dir is not set)"
            raise ResumeError(f"--resume: no saved buffer state in {where}")
        self.state = BufferState(cfg, prompts, self.store)
        if self.store:
            self.store.lock()
            saved = self.store.load() if self.store.exists() else None
            self.store.open()
            if saved is not None:
                self._restore(saved)

        self.endpoints = endpoints(cfg.host, cfg.port)
        self.ctx = zmq.Context()
        self.control = self._bind(zmq.ROUTER, "control")
        self.ingest = self._bind(zmq.PULL, "ingest")
        self.relay_in = self._bind(zmq.PULL, "relay_in")
        self.relay_out = self._bind(zmq.PUSH, "relay_out")
        self.poller = zmq.Poller()
        for s in (self.control, self.ingest, self.relay_in):
            self.poller.register(s, zmq.POLLIN)
        self._relay_pending: list | None = None  # a message relay_out could not take yet
        self._relay_polled = None
        self._next_expiry = 0.0
        self._next_summary = time.monotonic() + cfg.log_interval_s
        self._summary_rollouts = 0

    def _bind(self, kind: int, name: str) -> zmq.Socket:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if kind in (zmq.PULL, zmq.ROUTER):
            s.setsockopt(zmq.RCVHWM, 1000)
            # a peer sending a bigger frame is disconnected before the frame fills our memory
            s.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
        try:
            s.bind(self.endpoints[name])
        except zmq.ZMQError as e:
            s.close()
            self.close_sockets()
            raise OSError(f"buffer cannot bind {name} socket to {self.endpoints[name]}: {e}") from None
        return s

    def _restore(self, saved) -> None:
        groups = {}
        for gid, frames in saved.groups.items():
            try:
                metas = [scored_meta(f, f"state group {gid}", self.limits) for f in frames]
                groups[gid] = [Sample(f, saved.version if m.min_version is None else m.min_version, m.reward,
                                      -1 if m.max_version is None else m.max_version)
                               for m, f in zip(metas, frames)]
            except ProtocolError as e:
                log.warning("state: group %d cannot be read back (%s); dropping it", gid, e)
        self.state.restore(saved, groups)
        log.info("restored from %s: version %d, %d groups issued, %d accepted and unserved, %d to issue again; "
                 "nothing is leased or served until the learner's resume handshake", self.store.path,
                 saved.version, saved.next_group, len(self.state.ready), len(saved.open_groups))

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT: wait on the sockets, handle what came, expire leases, log."""
        if threading.current_thread() is threading.main_thread():  # (a test may run it in a thread)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        print("buffer ready " + " ".join(f"{k}={v}" for k, v in self.endpoints.items()), flush=True)
        log.info("serving %d prompts x %d epochs, %d groups of %d per step, max_staleness %d",
                 self.state.order.n, self.cfg.max_epochs, self.cfg.prompts_per_step,
                 self.cfg.n_samples_per_prompt, self.cfg.max_staleness)
        while not self.stopping:
            self._poll_relay_when_it_can_move()
            events = dict(self.poller.poll(POLL_MS))
            if self.control in events:
                self._drain(self.control, self.on_control)
            if self.ingest in events:
                self._drain(self.ingest, self.on_ingest)
            if self.relay_in in events or self.relay_out in events:
                self.forward_relay()
            now = time.monotonic()
            if now >= self._next_expiry:
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
        self.stopping = True

    def _drain(self, sock: zmq.Socket, handle) -> None:
        for _ in range(DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handle(frames)
            except Exception:  # a bug must not take the buffer (and every accepted rollout) down
                self.state.counters["internal_errors"] += 1
                log.exception("internal error while handling a message; carrying on")

    # ---- control: one request, one reply ---------------------------------------------------

    def on_control(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) < 3 or frames[1] != b"":
            # a DEALER must send [b"", *message], like a REQ socket does
            self._malformed("control", ProtocolError("message", "expected an empty delimiter frame then the message"))
            reply = encode(Error("message: expected an empty delimiter frame then the message", "message"))
        else:
            try:
                reply = self.handle_request(frames[2:])
            except ProtocolError as e:
                self._malformed("control", e)
                reply = encode(Error(str(e), e.field))
            except RequestError as e:
                reply = encode(Error(e.message, e.field))
            except Exception as e:
                self.state.counters["internal_errors"] += 1
                log.exception("internal error while serving a request")
                reply = encode(Error(f"internal error in the buffer: {type(e).__name__}: {e}"))
        self.control.send_multipart([identity, b"", *reply])

    def handle_request(self, body: Sequence[bytes]) -> list[bytes]:
        """The reply frames to one request (the frames after the delimiter)."""
        now = time.monotonic()
        kind, _ = decode_envelope(body, self.limits)
        if kind == "scored":
            accepted, rejected = self.take_scored(body[1:])
            return encode(Ack(accepted, rejected, f"{accepted} accepted, {rejected} refused (late or duplicate)"))
        if kind in NOT_REQUESTS:
            raise ProtocolError("envelope.type", f"{kind!r} is not a request the buffer serves on control")
        msg = decode(body, self.limits)
        if isinstance(msg, LeaseRequest):
            reply = self.state.lease(msg.worker_id, msg.max_groups, now, msg.version)
            if isinstance(reply, Wait):
                log.debug("lease for %s: wait (%s)", msg.worker_id, reply.reason)
            else:
                log.debug("lease %d to %s: groups %s", reply.lease_id, msg.worker_id,
                          _ids([g.group_id for g in reply.groups]))
            return encode(reply)
        if isinstance(msg, LeaseRenew):
            self.state.renew(msg.lease_id, now)
            return encode(Ack(1, 0, f"lease {msg.lease_id} renewed for {self.cfg.lease_ttl_s}s"))
        if isinstance(msg, GroupFailed):
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
            return encode(Metrics(self.state.metrics(now)))
        raise ProtocolError("envelope.type", f"{type(msg).__name__} is not a request the buffer serves")

    # ---- scored rollouts -------------------------------------------------------------------

    def on_ingest(self, frames: list[bytes]) -> None:
        try:
            kind, _ = decode_envelope(frames, self.limits)
            if kind != "scored":
                raise ProtocolError("envelope.type", f"ingest takes `scored` messages, got {kind!r}")
            self.take_scored(frames[1:])
        except ProtocolError as e:
            self._malformed("ingest", e)

    def take_scored(self, item_frames: Sequence[bytes]) -> tuple[int, int]:
        """Check every item of a `scored` message, then hand them to the bookkeeping: a message is
        taken whole or refused whole (ProtocolError), so a bad item never leaves half a message in."""
        n = self.cfg.n_samples_per_prompt
        metas = []
        for i, f in enumerate(item_frames):
            m = scored_meta(f, f"scored[{i}]", self.limits)
            if m.sample_index >= n:
                raise ProtocolError(f"scored[{i}].rollout.sample_index",
                                    f"{m.sample_index} >= n_samples_per_prompt {n}")
            metas.append(m)
        accepted = 0
        now = time.monotonic()
        for m, f in zip(metas, item_frames):
            outcome = self.state.add_sample(m.group_id, m.sample_index, m.lease_id, m.failed, m.min_version,
                                            m.reward, f, m.max_version, now)
            if outcome in ("accepted", "complete"):
                accepted += 1
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
                    frames = self.relay_in.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
                try:
                    kind, _ = decode_envelope(frames, self.limits)
                    if kind != "rollouts":
                        raise ProtocolError("envelope.type", f"the relay takes `rollouts` messages, got {kind!r}")
                except ProtocolError as e:
                    self._malformed("relay", e)
                    continue
                self._relay_pending = frames
            try:
                self.relay_out.send_multipart(self._relay_pending, zmq.NOBLOCK)
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
                 "stale %d failed %d overflow %d | late %d malformed %d | %.0f rollouts/s in",
                 m["buffer/version"], m["buffer/queued_groups"], m["buffer/leased_groups"],
                 m["buffer/issued_groups"], m["buffer/total_groups"], m["buffer/accepted_groups"],
                 m["buffer/served_groups"], m["buffer/dropped_stale"], m["buffer/failed_groups"],
                 m["buffer/dropped_overflow"], m["buffer/late"], m["buffer/malformed"],
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
        self.ctx.term()
        if self.store:
            self.store.snapshot(self.state)
            self.store.close()
            log.info("state written to %s", self.store.path)
        log.info("stopped: %d groups accepted, %d served", self.state.counters["accepted_groups"],
                 self.state.counters["served_groups"])


def _ids(ids: list[int], shown: int = 8) -> str:
    return ", ".join(map(str, ids[:shown])) + (f" ... ({len(ids)} in all)" if len(ids) > shown else "")


def serve(cfg: BufferConfig, resume: bool = False) -> int:
    """Run a buffer until SIGTERM/SIGINT; the exit status."""
    BufferService(cfg, resume).run()
    return 0
