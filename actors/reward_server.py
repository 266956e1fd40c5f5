"""A reward model behind HTTP: `python -m launch.serve_rm` serves the scorer's reward model to clients
that speak OpenRLHF's remote reward protocol or Conveyor's own (the scorer's `remote` kind).

    POST /get_reward, POST /reward   either form below, told apart by its keys
    GET  /health                     {"status": "ok", "model": ...}; needs no token
    GET  /stats                      request and batch counts: how requests were gathered into batches

OpenRLHF's form (its `SingleTurnAgentExecutor`, `--reward.remote_url`), `query` being the decoded
prompt + completion with its special tokens kept, so it is tokenized without adding any (as
OpenRLHF's serve_rm does):

    {"query": [text, ...], "prompts": [...], "labels": [...]}
      -> {"rewards": [r, ...], "scores": [r, ...], "extra_logs": {"raw_reward": [raw, ...]}}

Conveyor's form (actors/rewards.py `RemoteReward`), scored exactly as the scorer's `reward_model`
kind scores prompt + completion (`RewardModel`: the tokenizer adds its special tokens):

    {"prompts": [...], "completions": [...], "labels": [...]}  ->  {"rewards": [r, ...]}

A body with both `query` and `completions`, or neither, is refused. Each text is truncated to its
last `max_len` tokens (the completion is what is judged). With `normalize`, r = (raw - mean) / std
with the `mean` and `std` of the reward model's config.json, as OpenRLHF's reward model applies them.

The loop: the handler reads the body (refusing more than `max_body_bytes` or `max_texts` texts, 413),
checks it (400 with the reason), tokenizes it in a worker thread and queues it. One batcher
coroutine takes the first queued request, gathers more for up to `max_wait_ms` while they fit in
`batch_size` texts, scores them in one forward pass (in a worker thread, so the server keeps
answering) and answers each request with its own slice. A failed forward pass answers its batch's
requests 500 and the next batch is scored as usual.

Not open to the world by default: it binds 127.0.0.1, and with a token (`token`, or the environment
variable CONVEYOR_RM_TOKEN) every request but /health needs `Authorization: Bearer <token>` (401).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from actors.config import Dtype
from common.config import ConfigError, Section
from common.ready import mark_ready

log = logging.getLogger("conveyor.serve_rm")
TOKEN_ENV = "CONVEYOR_RM_TOKEN"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RewardServerConfig(Section):
    """Section `serve_rm:` of the run config: the reward model, how requests are batched, who may ask."""

    section: ClassVar[str] = "serve_rm"

    model: str = ""
    """An `AutoModelForSequenceClassification` folder with one label (what `launch.rm` saves, what
    `scorer.reward_model` loads); its score of the last token of a text is the reward."""
    normalize: bool = False
    """Answer (raw - mean) / std with the `mean` and `std` stored in the model's config.json (as
    OpenRLHF's `--reward.normalize_enable`); a folder without them is refused at start."""
    max_len: int = Field(2048, ge=2)
    """Tokens of a text the model sees at most (its tail is kept)."""
    dtype: Dtype = "float32"
    """Dtype the reward model is loaded in."""
    device: str = "cpu"
    """Torch device of the reward model."""

    host: str = "127.0.0.1"
    """Address to listen on; 0.0.0.0 (every interface) only when asked, best with a token."""
    port: int = Field(5000, ge=0, lt=65536)
    """Port to listen on; 0: one the system picks (the ready file and the log say which)."""
    token: str = ""
    """Bearer token every request but /health must carry; empty: the environment variable
    CONVEYOR_RM_TOKEN, and with neither set no token is asked for."""

    batch_size: int = Field(16, ge=1)
    """Texts per forward pass: concurrent requests are gathered up to this many texts."""
    max_wait_ms: float = Field(10.0, ge=0, allow_inf_nan=False)
    """How long a batch waits for more requests after its first one arrived."""
    max_texts: int = Field(1024, ge=1)
    """Texts one request may hold; more: 413."""
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1)
    """Bytes one request body may hold; more: 413."""
    log_every_s: float = Field(30.0, gt=0)
    """Request and batch counts are logged this often (when there were requests)."""

    def missing(self) -> list[str]:
        return [] if self.model else ["serve_rm.model is empty: the reward model folder to serve"]


class RequestError(Exception):
    """A request answered with `status` and `{"error": message}`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, max_texts: int) -> tuple[list[str], bool, bool]:
    """(texts, add_special_tokens, openrlhf_form) of a request body; raises RequestError (400, 413)."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(req).__name__}")
    if ("query" in req) == ("completions" in req):
        raise RequestError(400, "give either `query` (OpenRLHF's form) or `prompts` + `completions` "
                                "(Conveyor's), not " + ("both" if "query" in req else "neither"))
    if "query" in req:
        texts = _strings(req, "query", max_texts)
        for key in ("prompts", "labels"):  # OpenRLHF sends them alongside; the model does not read them
            if req.get(key) is not None and (not isinstance(req[key], list) or len(req[key]) != len(texts)):
                raise RequestError(400, f"`{key}` must be a list as long as `query` ({len(texts)})")
        return texts, False, True
    prompts, completions = _strings(req, "prompts", max_texts), _strings(req, "completions", max_texts)
    if len(prompts) != len(completions):
        raise RequestError(400, f"`prompts` has {len(prompts)} texts but `completions` has {len(completions)}")
    return [p + c for p, c in zip(prompts, completions)], True, False


def _strings(req: dict, key: str, max_texts: int) -> list[str]:
    value = req.get(key)
    if not isinstance(value, list):
        raise RequestError(400, f"`{key}` must be a list of strings, got {type(value).__name__}")
    if len(value) > max_texts:
        raise RequestError(413, f"`{key}` has {len(value)} texts; at most serve_rm.max_texts={max_texts}")
    bad = [i for i, v in enumerate(value) if not isinstance(v, str)]
    if bad:
        raise RequestError(400, f"`{key}[{bad[0]}]` is of type {type(value[bad[0]]).__name__}, not a string")
    return value


class TextScorer:
    """The reward model as the scorer loads it (actors.rewards.RewardModel), scoring token ids."""

    def __init__(self, cfg: RewardServerConfig):
        from actors.rewards import RewardModel

        try:
            self.rm = RewardModel(cfg.model, dtype=cfg.dtype, device=cfg.device, batch_size=cfg.batch_size,
                                  max_len=cfg.max_len, normalize=cfg.normalize, normalize_key="serve_rm.normalize")
        except ValueError as e:  # (a folder that is not a one-label classifier, or no stored statistics)
            raise ConfigError(f"serve_rm.model={cfg.model!r}: {e}") from None
        self.tokenizer, self.max_len = self.rm.tokenizer, self.rm.max_len
        self.tokenizing = threading.Lock()

    def tokenize(self, texts: list[str], special: bool) -> list[list[int]]:
        """Each text's ids, its last max_len kept (the tokenizer truncates from the left)."""
        with self.tokenizing:  # a fast tokenizer's settings are not safe to set from two threads at once
            ids = self.tokenizer(texts, add_special_tokens=special, truncation=True,
                                 max_length=self.max_len)["input_ids"]
        empty = [i for i, x in enumerate(ids) if not x]
        if empty:
            raise RequestError(400, f"text {empty[0]} has no tokens: the model has nothing to score")
        return ids

    def score(self, ids: list[list[int]]) -> list[float]:
        """The raw score of each sequence: the head's output at its last token."""
        return self.rm.raw_scores(ids)

    def normalized(self, raw: list[float]) -> list[float]:
        return self.rm.normalized(raw)


@dataclass
class Pending:
    """One request's tokenized texts, waiting for its batch; `answer` gets its raw scores."""

    ids: list[list[int]]
    answer: asyncio.Future = field(repr=False)


class Batcher:
    """Gathers queued requests into batches of up to `batch_size` texts, scores each batch in a worker
    thread and answers every request with its own slice. Lives on the server's event loop."""

    def __init__(self, scorer: TextScorer, batch_size: int, max_wait_s: float):
        self.scorer, self.batch_size, self.max_wait_s = scorer, batch_size, max_wait_s
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self.held: Pending | None = None  # taken from the queue, too big for the batch being gathered
        self.batches, self.largest = 0, 0  # batches scored; most requests in one batch
        self.batch_texts: Counter = Counter()  # texts in a batch -> batches

    async def gather(self) -> list[Pending]:
        first = self.held if self.held is not None else await self.queue.get()
        self.held = None
        batch, n = [first], len(first.ids)
        deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while n < self.batch_size:
            try:
                nxt = await asyncio.wait_for(self.queue.get(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                break
            if n + len(nxt.ids) > self.batch_size:
                self.held = nxt  # the first of the next batch
                break
            batch.append(nxt)
            n += len(nxt.ids)
        return batch

    async def serve(self) -> None:
        while True:
            batch = [p for p in await self.gather() if not p.answer.done()]  # (a client that left: skipped)
            ids = [x for p in batch for x in p.ids]
            if not ids:
                continue
            try:
                raw: list[float] = []
                for i in range(0, len(ids), self.batch_size):  # (one request longer than a batch: in parts)
                    raw += await asyncio.to_thread(self.scorer.score, ids[i:i + self.batch_size])
            except Exception as e:
                log.exception("a batch of %d texts failed", len(ids))
                for p in batch:
                    if not p.answer.done():
                        p.answer.set_exception(RequestError(500, f"scoring failed: {type(e).__name__}: {e}"))
                continue
            self.batches += 1
            self.largest = max(self.largest, len(batch))
            self.batch_texts[len(ids)] += 1
            start = 0
            for p in batch:
                if not p.answer.done():
                    p.answer.set_result(raw[start:start + len(p.ids)])
                start += len(p.ids)


class RewardServer:
    """The HTTP endpoint on its own event loop thread (uvicorn + Starlette); `close` stops it."""

    def __init__(self, cfg: RewardServerConfig, scorer: TextScorer, token: str = ""):
        import uvicorn

        self.cfg, self.scorer, self.token = cfg, scorer, token
        self.requests, self.texts = 0, 0
        self.refused: Counter = Counter()  # status -> requests
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as e:
            sock.close()
            raise OSError(f"serve_rm.host={cfg.host!r} port={cfg.port}: cannot bind: {e}") from None
        self.port = sock.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        self.batcher = Batcher(scorer, cfg.batch_size, cfg.max_wait_ms / 1000)
        self._thread = threading.Thread(target=self.loop.run_forever, name="serve-rm", daemon=True)
        self._thread.start()
        self._batching = asyncio.run_coroutine_threadsafe(self.batcher.serve(), self.loop)
        self._server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning", access_log=False,
                                                     lifespan="off", timeout_keep_alive=60))
        self.serving = asyncio.run_coroutine_threadsafe(self._server.serve(sockets=[sock]), self.loop)
        deadline = time.monotonic() + 30
        while not self._server.started:
            if self.serving.done() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the reward server on {cfg.host}:{self.port} did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        return f"http://{host}:{self.port}"

    def stats(self) -> dict:
        b = self.batcher
        return {"requests": self.requests, "texts": self.texts, "batches": b.batches,
                "largest_batch_requests": b.largest,
                "batch_texts": {str(k): v for k, v in sorted(b.batch_texts.items())},
                "refused": {str(k): v for k, v in sorted(self.refused.items())}}

    def close(self) -> None:
        self._server.should_exit = True
        try:
            self.serving.result(timeout=10)
        except Exception:  # (it may have failed to start; its error was said already)
            pass
        self._batching.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def guarded(request, handler):
            try:
                self.authorize(request)
                return JSONResponse(await handler(request))
            except RequestError as e:
                self.refused[e.status] += 1
                headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
                return JSONResponse({"error": str(e)}, status_code=e.status, headers=headers)

        async def reward(request):
            return await guarded(request, self.reward)

        async def stats(request):
            async def counts(_):
                return self.stats()

            return await guarded(request, counts)

        async def health(_):
            return JSONResponse({"status": "ok", "model": self.cfg.model, "normalize": self.cfg.normalize})

        return Starlette(routes=[Route("/get_reward", reward, methods=["POST"]),
                                 Route("/reward", reward, methods=["POST"]),
                                 Route("/stats", stats, methods=["GET"]), Route("/health", health, methods=["GET"])])

    def authorize(self, request) -> None:
        if not self.token:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            raise RequestError(401, "this reward server needs `Authorization: Bearer <token>` (serve_rm.token)")

    async def reward(self, request) -> dict:
        body = await read_body(request, self.cfg.max_body_bytes)
        texts, special, openrlhf = parse_request(body, self.cfg.max_texts)
        ids = await asyncio.to_thread(self.scorer.tokenize, texts, special) if texts else []
        self.requests += 1
        self.texts += len(texts)
        raw: list[float] = []
        if ids:
            pending = Pending(ids, self.loop.create_future())
            await self.batcher.queue.put(pending)
            raw = await pending.answer
        rewards = self.scorer.normalized(raw)
        if not all(math.isfinite(r) for r in rewards):
            raise RequestError(500, "the reward model gave a non-finite score")
        if openrlhf:
            return {"rewards": rewards, "scores": rewards, "extra_logs": {"raw_reward": raw}}
        return {"rewards": rewards}


async def read_body(request, limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes before more of it is read."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise RequestError(413, f"the body has {length} bytes; at most serve_rm.max_body_bytes={limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(413, f"the body has more than serve_rm.max_body_bytes={limit} bytes")
    return bytes(body)


def run(cfg: RewardServerConfig, stop: threading.Event | None = None) -> int:
    """Serve until a signal comes (or `stop` is set); the exit code. Without `stop`, SIGTERM/SIGINT
    are handled (on the main thread)."""
    if stop is None:
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, frame: stop.set())
    if not (Path(cfg.model) / "config.json").is_file():
        raise ConfigError(f"serve_rm.model={cfg.model!r} is not a model folder (it has no config.json)")
    token = cfg.token or os.environ.get(TOKEN_ENV, "")
    scorer = TextScorer(cfg)
    server = RewardServer(cfg, scorer, token)
    if cfg.host not in LOOPBACK and not token:
        log.warning("serving on %s without a token: anyone who reaches it can use the model "
                    "(set serve_rm.token or %s)", cfg.host, TOKEN_ENV)
    log.info("reward model %s on %s (POST /get_reward, /reward; normalize=%s mean=%g std=%g; batch_size=%d, "
             "token %s)", cfg.model, server.url, cfg.normalize, scorer.rm.mean, scorer.rm.std, cfg.batch_size,
             "required" if token else "not required")
    mark_ready("serve_rm", url=server.url, port=server.port)
    code, t_log, last = 0, time.monotonic(), 0
    try:
        while not stop.wait(0.5):
            if server.serving.done():
                log.error("the HTTP server stopped: %r", server.serving.exception())
                code = 1
                break
            if time.monotonic() - t_log >= cfg.log_every_s and server.requests > last:
                log.info("%s", server.stats())
                t_log, last = time.monotonic(), server.requests
    finally:
        log.info("exiting: %s", server.stats())
        server.close()
    return code
