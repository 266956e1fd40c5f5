"""The generator's OpenAI-compatible endpoint, for agent code written against the `openai` client.

With `generator.agent` set, the generator serves, on `generator.openai_host:openai_port` (port 0:
one the system picks), for the life of the generator:

    POST /s/<session>/v1/chat/completions     the OpenAI chat schema (messages, tools, max_tokens,
    POST /s/<session>/v1/completions          logprobs); completions: one prompt string
    POST /s/<session>/reward                  {"reward": float}: the session's reward
    GET  /s/<session>/v1/models, /v1/models   the one model
    GET  /health                              200 once it serves

`/v1/...` and `/reward` without the `/s/<session>` prefix take the session id as the bearer token
(`api_key=<session>`), for agent code that only lets one set the key. Each sample of a lease is a
session; its agent gets `base_url = http://host:port/s/<session>/v1` (actors/agents/sessions.py
says what a session records and when it fails). Answers follow the OpenAI schema (id, object,
created, model, choices, usage; `logprobs` when asked: the behaviour log-probs) closely enough
for the `openai` client; errors are `{"error": {"message", "type", "code"}}` with status 400 (a
request that cannot be served, or does not extend its session), 404 (no such open session) or 409
(a closed session, or a second request while one is served). `stop` (a string or up to 4) ends a
turn as OpenAI's does: the answer's text leaves the stop string out, while the session keeps every
id sampled, the one that completed it included. `stream` and `n` > 1 are refused; `temperature`,
`top_p` and the like are ignored: the behaviour distribution is the run's (the generator's
sampling settings), which the learner's objective is built around.

One event loop, in a thread of its own, runs everything of the agent path: uvicorn's server, the
sessions, the agents' coroutines and the lease's engine batches (`actors.envs.episodes.Batcher`, whose
engine calls go to a worker thread). The generator's loop hands each lease to it (`play`) and
waits. So session state is only ever touched from that loop (no locks), the address answers at
all times (a session of a past lease gets a prompt 404, not a wait in a socket's backlog), and it
is up, port bound, before the first lease.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Callable

from fastapi import FastAPI, Request  # (module level: FastAPI reads the handlers' annotations from here)
from fastapi.responses import JSONResponse

from actors.agents.sessions import RequestError, Sessions, answer_text

log = logging.getLogger("conveyor.generator")
MAX_STOP, MAX_STOP_CHARS = 4, 256  # a request's stop strings


class AgentServer:
    """The endpoint and the agent it serves; `play` runs one lease's sessions, `close` stops it."""

    def __init__(self, agent: Callable, agent_args: dict, host: str = "127.0.0.1", port: int = 0,
                 model_name: str = "policy", tokenizer=None):
        import uvicorn

        self.model_name = model_name
        self.sessions = Sessions(agent, agent_args, self.base_url, tokenizer)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise OSError(f"generator.openai_host={host!r} openai_port={port}: cannot bind: {e}") from None
        self.host, self.port = host, sock.getsockname()[1]
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="openai-endpoint", daemon=True)
        self._thread.start()
        self._server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning", access_log=False,
                                                     lifespan="off", timeout_keep_alive=60))
        self._serving = asyncio.run_coroutine_threadsafe(self._server.serve(sockets=[sock]), self.loop)
        deadline = time.monotonic() + 30
        while not self._server.started:
            if self._serving.done() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the OpenAI endpoint on {host}:{self.port} did not start")
            time.sleep(0.01)
        log.info("OpenAI endpoint for agents on %s", self.url)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        return f"{self.url}/s/{session_id}/v1"

    def play(self, groups, n: int, engine, sampling, cfg, generate, counts) -> dict:
        """`Sessions.play` on the endpoint's loop: {group_id: episodes} once every session ended."""
        fut = asyncio.run_coroutine_threadsafe(self.sessions.play(groups, n, engine, sampling, cfg, generate, counts),
                                               self.loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # (a second signal: the lease is abandoned)
            raise

    def close(self) -> None:
        if not self.loop.is_running():
            return
        self._server.should_exit = True
        try:
            self._serving.result(timeout=10)
        except Exception as e:  # (it failed to start, or hung closing connections: stopped below either way)
            log.warning("OpenAI endpoint: %s: %s", type(e).__name__, e)
        asyncio.run_coroutine_threadsafe(self.loop.shutdown_default_executor(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    # ---- the HTTP side ----------------------------------------------------------------------

    def app(self) -> FastAPI:
        app = FastAPI(title="Conveyor generator: OpenAI-compatible endpoint for agents")

        @app.exception_handler(RequestError)
        async def request_error(_, e: RequestError):
            kind = {404: "not_found_error", 409: "conflict_error"}.get(e.status, "invalid_request_error")
            return JSONResponse({"error": {"message": e.message, "type": kind, "code": e.status}}, e.status)

        async def body(request: Request) -> dict:
            try:
                out = await request.json()
            except ValueError:
                raise RequestError(400, "the request body is not JSON") from None
            if not isinstance(out, dict):
                raise RequestError(400, "the request body must be a JSON object")
            return out

        @app.post("/s/{sid}/v1/chat/completions")
        async def chat(sid: str, request: Request):
            return await self._chat(sid, await body(request))

        @app.post("/s/{sid}/v1/completions")
        async def completions(sid: str, request: Request):
            return await self._complete(sid, await body(request))

        @app.post("/s/{sid}/reward")
        async def reward(sid: str, request: Request):
            return self._reward(sid, await body(request))

        @app.post("/v1/chat/completions")
        async def chat_by_key(request: Request):
            return await self._chat(_bearer(request), await body(request))

        @app.post("/v1/completions")
        async def completions_by_key(request: Request):
            return await self._complete(_bearer(request), await body(request))

        @app.post("/reward")
        async def reward_by_key(request: Request):
            return self._reward(_bearer(request), await body(request))

        @app.get("/v1/models")
        @app.get("/s/{sid}/v1/models")
        async def models(sid: str = ""):
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "conveyor"}]}

        @app.get("/health")
        async def health():
            return {"ok": True, "sessions": len(self.sessions.open)}

        return app

    async def _chat(self, sid: str, req: dict) -> dict:
        _one_choice(req)
        if "messages" not in req:
            raise RequestError(400, "a chat request needs messages")
        s, c, message, prompt_tokens = await self.sessions.chat(
            sid, req["messages"], req.get("tools") or None, _max_tokens(req, "max_completion_tokens", "max_tokens"),
            _stop(req))
        tok, logprobs = s.lease.tokenizer, None
        if req.get("logprobs"):
            logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                    for t, lp in zip(_pieces(tok, c.token_ids), c.logprobs)]}
        finish = "tool_calls" if message.get("tool_calls") else c.finish_reason
        return self._response(s, "chat.completion", req, prompt_tokens, c,
                              {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs})

    async def _complete(self, sid: str, req: dict) -> dict:
        _one_choice(req)
        prompt = req.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError(400, "a completions request needs one prompt string (token ids and several prompts "
                                    "are not served)")
        s, c, prompt_tokens = await self.sessions.complete(sid, prompt, _max_tokens(req, "max_tokens"), _stop(req))
        logprobs = None
        if req.get("logprobs") is not None and req.get("logprobs") is not False:  # (0 asks for them too)
            pieces = _pieces(s.lease.tokenizer, c.token_ids)
            offsets = [len(prompt) + sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
            logprobs = {"tokens": pieces, "token_logprobs": list(c.logprobs), "top_logprobs": None,
                        "text_offset": offsets}
        return self._response(s, "text_completion", req, prompt_tokens, c,
                              {"index": 0, "text": answer_text(c), "finish_reason": c.finish_reason,
                               "logprobs": logprobs})

    def _reward(self, sid: str, req: dict) -> dict:
        if "reward" not in req:
            raise RequestError(400, 'a reward request is {"reward": <number>}')
        self.sessions.report(sid, req["reward"])
        return {"ok": True}

    def _response(self, s, kind: str, req: dict, prompt_tokens: int, c, choice: dict) -> dict:
        t = len(c.token_ids)
        return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{s.id}-{s.episode.turns}", "object": kind,
                "created": int(time.time()), "model": req.get("model") or self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": t, "total_tokens": prompt_tokens + t}}


def _bearer(request) -> str:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise RequestError(404, "no session: use base_url .../s/<session>/v1, or the session id as the api_key")
    return token.strip()


def _one_choice(req: dict) -> None:
    if req.get("stream"):
        raise RequestError(400, "stream=true is not served: a session's turns are answered whole")
    if req.get("n") not in (None, 1):
        raise RequestError(400, f"n={req.get('n')!r}: a session is one trajectory, one choice per request")


def _max_tokens(req: dict, *keys: str) -> int | None:
    for key in keys:
        value = req.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(400, f"{key}={value!r} must be a positive integer")
            return value
    return None


def _stop(req: dict) -> list[str]:
    """The request's `stop`: a string or a list of at most 4, as OpenAI's schema has it."""
    stop = req.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in stop)):
        raise RequestError(400, f"stop={req.get('stop')!r} must be a string or a list of at most {MAX_STOP} "
                                f"non-empty strings of at most {MAX_STOP_CHARS} characters")
    return stop


def _pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text, for `logprobs`."""
    return [tokenizer.decode([i]) for i in ids]
