"""The generator's weight-sync call site: register with the weight-sync service, poll it between
batches (and, in `interrupt` mode, while one runs), and load each new round into the engine.

The service and the receiver live in weight_sync/; this hook is the generator's side only. A
malformed reply from the service is counted and skipped (the engine keeps its weights, whose
version is still stamped truthfully), and so is a round the engine fails to load.
"""

from __future__ import annotations

import logging
import time

from actors.config import GeneratorConfig
from actors.engines.base import Engine
from common.guards import WarnLimiter
from common.wire import ProtocolError
from weight_sync.messages import RoundInfo
from weight_sync.receiver import fatal

log = logging.getLogger("conveyor.generator")


class WeightSyncHook:
    """Registers with the weight-sync service and loads each new round into the engine.

    `poll` runs between batches. In `interrupt` mode, with an engine that can load mid-batch,
    `generate_batch` also calls `poll_mid_batch` while a batch runs. Both on the loop's thread:
    the client's ZeroMQ socket is not thread-safe.
    """

    def __init__(self, ws, mode: str = "finish", timeout_s: float = 120.0, poll_s: float = 0.05):
        """`ws`: a registered `weight_sync.client.GeneratorSyncClient` (`connect` makes one)."""
        self.ws, self.mode = ws, mode  # mode: the service's, as last heard (every round repeats it)
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.deferred: dict | None = None  # a `finish` round that came mid-batch: loaded after it
        self.skipped = 0  # replies of the service that were malformed (the weights stay as they are)
        self.limited = WarnLimiter(log, every_s=30.0)

    @classmethod
    def connect(cls, cfg: GeneratorConfig, worker_id: str, engine: Engine) -> "WeightSyncHook":
        """Register `worker_id` with the run's weight-sync service; the hook of its rounds."""
        from weight_sync.client import GeneratorSyncClient

        ws = GeneratorSyncClient(cfg.weight_sync_host, cfg.weight_sync_port, worker_id)
        # world_size: the engine's workers that join a broadcast (vLLM's tensor-parallel ranks)
        reply = ws.register(cfg.engine, world_size=cfg.tensor_parallel_size if cfg.engine == "vllm" else 1)
        mode = reply.get("mode", "finish")
        if mode == "interrupt" and not engine.loads_mid_batch:
            log.warning("weight-sync mode 'interrupt' needs generator.engine=vllm and generator.async_engine=true; "
                        "this %s engine loads weights between batches", type(engine).__name__)
        return cls(ws, mode, cfg.weight_sync_timeout_s, cfg.weight_sync_poll_s)

    def initial(self, engine: Engine) -> None:
        """The current weights before the first lease (None: the learner has published nothing yet)."""
        round_info = self.ws.wait_current(self.timeout_s)
        if round_info is not None:
            self.apply(engine, round_info)

    def poll(self, engine: Engine) -> None:
        round_info, self.deferred = self.deferred, None
        round_info = round_info or self._poll()
        if round_info is not None:
            self.apply(engine, round_info)

    def _poll(self) -> RoundInfo | None:
        """The service's answer to a poll (None: no round now, or a malformed answer: `_ask`)."""
        return self._ask(self.ws.poll)

    def _ask(self, call, *args, **kwargs):
        """`call(...)` of the client; a malformed reply is counted and skipped (None): the next
        poll asks again, and tells the service this generator's version (a `done` whose answer was
        lost is not needed for that)."""
        try:
            return call(*args, **kwargs)
        except ProtocolError as e:
            self.skipped += 1
            self.limited.warn("malformed", "a malformed reply from the weight-sync service (%d so far): %s",
                              self.skipped, e)
            return None

    def poll_mid_batch(self, engine: Engine) -> None:
        if self.deferred is not None:
            return
        round_info = self._poll()
        if round_info is None:
            return
        if round_info.mode == "interrupt":
            self.apply(engine, round_info, mid_batch=True)
        else:  # the service now says `finish`: the batch ends on the weights it started with
            self.deferred = round_info

    def apply(self, engine: Engine, round_info: RoundInfo, mid_batch: bool = False) -> None:
        version = round_info.version
        self.mode = round_info.mode
        t0 = time.monotonic()
        try:
            engine.receive_weights(round_info)  # in `interrupt` mode: pause, load, resume; stamps the version
        except Exception as e:
            # Keep generating with the weights we have: their version is still stamped truthfully.
            log.error("weights v%d not loaded: %s: %s", version, type(e).__name__, e)
            self._ask(self.ws.done, version, ok=False, load_s=time.monotonic() - t0, error=f"{type(e).__name__}: {e}")
            if fatal(str(e)):  # (as it comes back from the engine's workers: text)
                # unless they are a mixture of two versions (it stops, to be restarted), or no round
                # can ever reach this engine where it runs (on learner rank 0's own GPU with no
                # slot it can use: it stops with the message that names the fix)
                raise
            return
        load_s = time.monotonic() - t0
        self._ask(self.ws.done, version, ok=True, load_s=load_s)
        log.info("weights v%d loaded%s (time/weight_sync %.2fs)", version,
                 " into the running batch" if mid_batch else "", load_s)

    def close(self) -> None:
        close = getattr(self.ws, "close", None)
        if close is not None:
            close()
