"""Agent sessions: black-box agent code plays a lease's samples through the OpenAI endpoint.

An agent is a function written against the `openai` client, named by `generator.agent`:

    async def agent(base_url: str, row: Row, **agent_args) -> float | None

(a plain `def` works too: it runs in a thread of its own). For each sample of a lease (n per
prompt, as episodes are) the generator opens a session and calls the agent with the session's
`base_url` (actors/agents/openai_server.py serves it); the agent sends `chat.completions.create` and
`completions.create` requests there, and returns its reward, or POSTs it to the session's
`/reward` and returns None. The session then becomes one rollout, an `actors.envs.episodes.Episode`
made into a `Rollout` by `rollout_of`; the reward travels as `env_reward` (scorer kind `env`).

A session's context is token ids, never a re-tokenisation of the text so far:

- its first request is encoded as a prompt is (chat: the tokenizer's chat template with
  `tools=` when given; completions: the prompt text with the tokenizer's specials);
- every later request must extend the session: a chat request's messages start with the previous
  request's messages and the assistant message this session returned; a completions prompt starts
  with the previous prompt and its completion. Only what is new is encoded (`encode_turn`: with a
  chat template, the ids the template writes after the model's end-of-turn token) and appended as
  context (action mask 0, behaviour log-prob 0); a model turn cut short gets its end-of-turn id
  first, as the template would render it;
- each sampled turn is appended as the engine sampled it (mask 1, with its behaviour log-probs
  and versions). Requests of every session of the lease share the engine's batches (`Batcher`).

Sampling is the generator's (temperature, top-p, top-k, stop tokens; an evaluation lease's
temperature), whatever a request asks; `max_tokens` is honoured, capped at
`generator.max_new_tokens`, and `stop` strings end a turn (`answer_text`: the answer leaves the
stop string out; the session's ids keep every token sampled). Limits as for episodes: \
`generator.max_turns` requests per session and
`generator.max_context_tokens` in all; a request past one is answered 400 and the session ends
truncated (finish_reason `length`; it still takes its reward).

A session fails (its group is given up, as a failed episode's is; counted by kind as
`sessions_<kind>` and in `sessions_failed`): `raised` (the agent raised), `bad_return` (it returned
something not a number, or reported a reward before any completion), `expired` (no reward
within `generator.session_timeout_s` of its agent's start; the agent is cancelled), `rewritten`
(a request that does not extend the session: answered 400), `bad_request` (a first prompt too
long for `generator.long_prompt: refuse`, a context the engine or chat template refused).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import secrets
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from actors.engines.base import Completion, Sampling
from actors.envs.api import BadReturn, EnvFailure, EnvLoadError, Row, in_thread, number, retrieve
from actors.envs.episodes import Batcher, Episode, context_limit
from actors.envs.files import load_object

SESSION_FAILURES = ("raised", "bad_return", "expired", "rewritten", "bad_request")
STAND_IN = "conveyor-stand-in-turn"  # the assistant turn the chat template renders new messages after


class RequestError(Exception):
    """A request the endpoint answers with `status` (400, 404, 409) and `message`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


# --------------------------------------------------------------------------------------------
# naming an agent in config


def load_agent(spec: str, kwargs: dict | None = None, key: str = "generator.agent") -> Callable:
    """The agent function of `spec` (`path/file.py:function` or `package.module:function`),
    checked to take `(base_url, row, **kwargs)`; errors quote `key` and the spec."""
    where = f"{key}={spec!r}"
    fn = load_object(spec, where)
    name = spec.rpartition(":")[2]
    if not callable(fn) or isinstance(fn, type):
        raise EnvLoadError(f"{where}: {name} is not a function")
    try:
        inspect.signature(fn).bind("http://base/v1", None, **(kwargs or {}))
    except TypeError as e:
        raise EnvLoadError(f"{where}: {name}{inspect.signature(fn)} cannot take (base_url, row) and the "
                           f"agent's arguments {kwargs or {}}: {e}") from None
    return fn


# --------------------------------------------------------------------------------------------
# encoding what a request adds


def text_of(content) -> str:
    """A message's content as text (a list of parts: their texts joined; None: "")."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise RequestError(400, f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _plain(messages: list[dict]) -> list[dict]:
    """Messages as the chat template takes them: content as text, the other keys as they came."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise RequestError(400, "messages must be a list of objects with a role")
    return [{**m, "content": text_of(m.get("content"))} for m in messages]


def _chat_template(tokenizer, use_chat_template: bool) -> bool:
    return use_chat_template and bool(getattr(tokenizer, "chat_template", None))


def encode_first(tokenizer, messages: list[dict], tools, use_chat_template: bool) -> list[int]:
    """A session's first chat request as a prompt is encoded (actors.prompts.encode_prompt, with `tools`)."""
    if _chat_template(tokenizer, use_chat_template):
        return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                  return_dict=False))
    ids = list(tokenizer.encode(messages[0]["content"])) if messages else []
    for m in messages[1:]:
        ids += tokenizer.encode(m["content"], add_special_tokens=False)
    return ids


def encode_turn(tokenizer, messages: list[dict], tools, use_chat_template: bool) -> tuple[list[int], str]:
    """(ids, text) of `messages` appended after a model turn that ended with the eos token.

    With a chat template: what it writes after the eos of an assistant message, the messages and
    the next assistant turn's header, worked out (as `actors.envs.api.encode_observation` does for one
    message) from two renderings of a stand-in conversation, with `tools` in both. The text starts
    right after a special token, so its ids equal those of the whole conversation tokenised at
    once. Without one: the messages' contents, one after another.
    """
    if not _chat_template(tokenizer, use_chat_template):
        text = "".join(m["content"] for m in messages)
        return list(tokenizer.encode(text, add_special_tokens=False)), text
    before = [{"role": "user", "content": "u"}, {"role": "assistant", "content": STAND_IN}]
    base = tokenizer.apply_chat_template(before, tools=tools, tokenize=False)
    full = tokenizer.apply_chat_template(before + messages, tools=tools, tokenize=False, add_generation_prompt=True)
    eot = tokenizer.eos_token
    cut = base.rfind(eot) if eot else -1
    if not full.startswith(base) or cut < base.rfind(STAND_IN) + len(STAND_IN):
        raise ValueError("the chat template renders earlier turns differently once messages follow them, or does not "
                         f"end an assistant message with {eot!r}: new messages cannot be appended as ids")
    text = base[cut + len(eot):] + full[len(base):]
    return list(tokenizer.encode(text, add_special_tokens=False)), text


def assistant_message(text: str, tools) -> dict:
    """The assistant message a chat response carries: Hermes `<tool_call>`s as `tool_calls` when the
    request offered tools (actors/tools/registry.py parses them), the rest as content."""
    if tools and "<tool_call>" in text:
        from actors.tools.formats import HermesFormat

        calls = [c for c in HermesFormat().parse(text) if c.error is None]
        if calls:
            content = HermesFormat._CALL.sub("", text).strip()
            return {"role": "assistant", "content": content or None,
                    "tool_calls": [{"id": f"call_{k}", "type": "function",
                                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                   for k, c in enumerate(calls)]}
    return {"role": "assistant", "content": text}


def _norm(m: dict) -> tuple:
    """What must be equal for a message to count as the same one when a request repeats it."""
    calls = tuple((c.get("function", {}).get("name"), _args(c.get("function", {}).get("arguments")))
                  for c in m.get("tool_calls") or [])
    return m.get("role"), text_of(m.get("content")), calls, m.get("tool_call_id")


def _args(raw):
    try:
        return json.dumps(json.loads(raw) if isinstance(raw, str) else raw, sort_keys=True)
    except (TypeError, ValueError):
        return raw


# --------------------------------------------------------------------------------------------
# sessions


@dataclass
class Lease:
    """What every session of one lease shares."""

    engine: Any
    tokenizer: Any
    sampling: Sampling
    cfg: Any
    batcher: Batcher
    counts: Counter
    turns: set = field(default_factory=set)  # the sessions' turns waiting for the engine


@dataclass
class Session:
    """One sample played by one agent: its ids (in `episode`), what its next request must extend."""

    id: str  # random, unguessable: the path segment (or api_key) that names it
    episode: Episode
    lease: Lease
    reported: asyncio.Future  # the reward
    history: list[dict] | None = None  # chat: the last request's messages and the message returned
    text: str | None = None  # completions: the last prompt and its completion
    tools: Any = None
    busy: bool = False  # a request is being served (one at a time)
    closed: str = ""  # "" while open; "completed" or a failure kind
    agent: asyncio.Future | None = None  # the agent's call
    truncated: bool = False  # a request hit max_turns or the context limit (counted once)


class Sessions:
    """The open sessions of this generator, by id; used from the endpoint's event loop only."""

    def __init__(self, agent: Callable, agent_args: dict, base_url: Callable[[str], str], tokenizer=None):
        self.agent, self.agent_args, self.base_url = agent, dict(agent_args), base_url
        self.tokenizer = tokenizer  # None: the engine's
        self.open: dict[str, Session] = {}

    # ---- a lease ----------------------------------------------------------------------------

    async def play(self, groups, n: int, engine, sampling: Sampling, cfg, generate,
                   counts: Counter) -> dict[int, list[Episode]]:
        """One session per sample of the lease's groups, each played by an agent to its end:
        {group_id: episodes}, as `actors.envs.episodes.run_episodes` gives them."""
        lease = Lease(engine, self.tokenizer or engine.tokenizer, sampling, cfg, Batcher(generate), counts)
        loop = asyncio.get_running_loop()
        sessions = []
        for g in groups:
            for j in range(n):
                s = Session(secrets.token_hex(8), Episode(g, j, None, []), lease, loop.create_future())
                self.open[s.id] = s
                sessions.append(s)
        counts["sessions_opened"] += len(sessions)
        serving = asyncio.create_task(lease.batcher.serve())
        try:
            await asyncio.gather(*(self._drive(s) for s in sessions))
        finally:
            serving.cancel()
            for turn in list(lease.turns):  # (of sessions closed meanwhile: nobody waits for them)
                turn.cancel()
            for s in sessions:
                self.open.pop(s.id, None)
                if s.agent is not None:
                    s.agent.cancel()  # (still running after its reward: the lease is over)
        counts["engine_batches"] += lease.batcher.batches
        return {g.group_id: [s.episode for s in sessions if s.episode.group is g] for g in groups}

    async def _drive(self, s: Session) -> None:
        timeout = s.lease.cfg.session_timeout_s
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        s.agent = asyncio.ensure_future(self._call_agent(s))
        s.agent.add_done_callback(retrieve)
        await asyncio.wait({s.agent, s.reported}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if s.agent.done() and not s.reported.done():
            try:
                out = s.agent.result()
                if out is not None:
                    s.reported.set_result(number(out, "the reward"))
            except BadReturn as e:
                return self._fail(s, "bad_return", f"the agent {e}")
            except Exception as e:  # the agent's own code: anything may come out of it
                return self._fail(s, "raised", f"the agent raised {type(e).__name__}: {e}")
        if not s.reported.done() and not s.closed:  # (it returned None: the reward is POSTed)
            await asyncio.wait({s.reported}, timeout=max(0.0, until - loop.time()))
        if s.closed:
            return
        if not s.reported.done():
            s.agent.cancel()
            return self._fail(s, "expired", f"no reward within generator.session_timeout_s={timeout:g}")
        if not s.episode.turns:
            return self._fail(s, "bad_return", "the agent reported a reward for a session that sampled nothing")
        s.episode.reward, s.episode.finish, s.closed = s.reported.result(), s.episode.finish or "stop", "completed"
        s.lease.counts["sessions_completed"] += 1

    async def _call_agent(self, s: Session):
        url, row = self.base_url(s.id), Row.of(s.episode.group)
        if inspect.iscoroutinefunction(self.agent):
            return await self.agent(url, row, **self.agent_args)
        return await in_thread(lambda _: self.agent(url, row, **self.agent_args), None)

    def _fail(self, s: Session, kind: str, message: str) -> None:
        if s.closed:
            return
        s.closed, s.episode.failure = kind, EnvFailure(kind, f"session {s.id}: {message}")
        s.lease.counts[f"sessions_{kind}"] += 1
        s.lease.counts["sessions_failed"] += 1
        if not s.reported.done():
            s.reported.set_result(math.nan)  # (wakes _drive)

    # ---- requests ---------------------------------------------------------------------------

    def get(self, sid: str) -> Session:
        s = self.open.get(sid)
        if s is None:
            raise RequestError(404, f"no open session {sid!r}: the generator opens one per sample and hands "
                                    "its base_url to the agent")
        if s.closed or s.reported.done():
            raise RequestError(409, f"session {sid} is closed ({s.closed or 'its reward is in'})")
        return s

    def report(self, sid: str, reward) -> None:
        s = self.get(sid)
        try:
            s.reported.set_result(number(reward, "the reward"))
        except BadReturn as e:
            raise RequestError(400, f"session {sid}: {e}") from None

    async def chat(self, sid: str, messages, tools, max_tokens: int | None,
                   stop: list[str] = ()) -> tuple[Session, Completion, dict, int]:
        """Sample the next assistant turn: (session, completion, the message returned, prompt tokens)."""
        s = self._begin(sid)
        try:
            messages, lease = _plain(messages), s.lease
            if s.text is not None:
                self._rewritten(s, "a chat request cannot extend a session of completions")
            if s.history is None:
                s.tools = tools
                try:
                    ids = encode_first(lease.tokenizer, messages, tools, lease.cfg.use_chat_template)
                except Exception as e:  # (the template's own error: jinja raises what it likes)
                    self._bad(s, f"the chat template cannot render the messages: {type(e).__name__}: {e}")
                self._first(s, ids)
                new, text = [], ""
            else:
                k = len(s.history)
                if len(messages) <= k or [_norm(m) for m in messages[:k]] != [_norm(m) for m in s.history]:
                    self._rewritten(s, f"its messages must start with the previous request's {k - 1} messages "
                                       "and the assistant message this session returned, then add new ones")
                try:
                    new, text = encode_turn(lease.tokenizer, messages[k:], s.tools, lease.cfg.use_chat_template)
                except Exception as e:  # (as above)
                    self._bad(s, f"{type(e).__name__}: {e}")
                eos = lease.tokenizer.eos_token_id
                if _chat_template(lease.tokenizer, lease.cfg.use_chat_template) and s.episode.ids[-1:] != [eos]:
                    new = [eos] + new  # the turn was cut short: end it as the template renders it
            c, prompt_tokens = await self._sample(s, new, text, max_tokens, stop)
            message = assistant_message(answer_text(c), s.tools)
            s.history = messages + [message]
            return s, c, message, prompt_tokens
        finally:
            s.busy = False

    async def complete(self, sid: str, prompt: str, max_tokens: int | None,
                       stop: list[str] = ()) -> tuple[Session, Completion, int]:
        """Sample a continuation of `prompt`: (session, completion, prompt tokens)."""
        s = self._begin(sid)
        try:
            if s.history is not None:
                self._rewritten(s, "a completions request cannot extend a chat session")
            if s.text is None:
                self._first(s, list(s.lease.tokenizer.encode(prompt)))
                new, text = [], ""
            elif not prompt.startswith(s.text):
                self._rewritten(s, "its prompt must start with the previous prompt and the completion returned")
            else:
                text = prompt[len(s.text):]
                new = list(s.lease.tokenizer.encode(text, add_special_tokens=False)) if text else []
            c, prompt_tokens = await self._sample(s, new, text, max_tokens, stop)
            s.text = prompt + answer_text(c)
            return s, c, prompt_tokens
        finally:
            s.busy = False

    def _begin(self, sid: str) -> Session:
        s = self.get(sid)
        if s.busy:
            raise RequestError(409, f"session {sid} is serving a request already: one at a time per session")
        s.busy = True
        return s

    def _first(self, s: Session, ids: list[int]) -> None:
        cfg = s.lease.cfg
        if not ids:
            self._bad(s, "the first request's prompt is empty")
        if len(ids) > cfg.prompt_max_len:
            if cfg.long_prompt != "truncate":
                self._bad(s, f"prompt of {len(ids)} tokens > generator.prompt_max_len={cfg.prompt_max_len}")
            ids = ids[-cfg.prompt_max_len:]  # (as the generator truncates prompts: the tail holds the question)
        s.episode.prompt_ids = ids

    async def _sample(self, s: Session, new: list[int], text: str, max_tokens: int | None,
                      stop: list[str]) -> tuple[Completion, int]:
        e, lease = s.episode, s.lease
        limit = context_limit(lease.cfg)
        if e.turns >= lease.cfg.max_turns or len(e.prompt_ids) + len(e.ids) + len(new) >= limit:
            e.finish = "length"
            if not s.truncated:
                s.truncated = True
                lease.counts["sessions_truncated"] += 1
            raise RequestError(400, f"session {s.id} is at its limit (generator.max_turns={lease.cfg.max_turns} "
                                    f"requests, {limit} tokens of context): report its reward")
        if new:
            e.add(new, 0, text=text)
        room = limit - len(e.prompt_ids) - len(e.ids)
        cap = min(lease.sampling.max_tokens, room, max_tokens or lease.sampling.max_tokens)
        context = e.prompt_ids + e.ids
        sampling = replace(lease.sampling, max_tokens=max(1, cap), stop=[*lease.sampling.stop, *stop])
        turn = asyncio.ensure_future(lease.batcher.sample(context, sampling))
        lease.turns.add(turn)
        turn.add_done_callback(lease.turns.discard)
        # A session that closes meanwhile (expired) answers at once; its turn is left to its batch.
        await asyncio.wait({turn, s.reported}, return_when=asyncio.FIRST_COMPLETED)
        if s.closed or not turn.done():
            raise RequestError(409, f"session {s.id} closed while its request was sampled ({s.closed or 'reward in'})")
        try:
            c = turn.result()
        except Exception as err:  # (the engine refused the context: this session's, at least)
            self._bad(s, f"the engine refused its context of {len(context)} tokens: {type(err).__name__}: {err}")
        e.add(c.token_ids, 1, c.logprobs,
              c.versions if c.versions is not None else [lease.engine.version] * len(c.token_ids), c.text)
        e.turns += 1
        return c, len(context)

    def _rewritten(self, s: Session, why: str) -> None:
        self._fail(s, "rewritten", f"a request rewrote the session's history: {why}")
        raise RequestError(400, f"session {s.id}: the request does not extend the session ({why}); "
                                "the session is failed")

    def _bad(self, s: Session, why: str) -> None:
        self._fail(s, "bad_request", why)
        raise RequestError(400, f"session {s.id}: {why}; the session is failed")


def answer_text(c: Completion) -> str:
    """A turn's text as the agent gets it: without the stop string that ended it (OpenAI's `stop`)."""
    if isinstance(c.stop_reason, str) and c.text.endswith(c.stop_reason):
        return c.text[:len(c.text) - len(c.stop_reason)]
    return c.text
