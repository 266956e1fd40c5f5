"""OpenRLHF agent files that drive generation themselves: an `AgentExecutor` with its own `execute`.

OpenRLHF 0.11 builds the file's `AgentExecutor()` once per engine and, per sample, awaits
`execute(prompt=, label=, sampling_params=, max_length=, hf_tokenizer=, llm_engine=, images=None)`;
the file samples through `await llm_engine.generate(token_ids, sampling_params, multi_modal_data=None)`
and returns the episode as a dict. A file whose `AgentExecutor` only names its agent class (a
`MultiTurnAgentExecutor` that keeps OpenRLHF's `execute`) is played by actors/envs/openrlhf_agent.py
instead. For a file with its own `execute`, `load_env` returns an `ExecutorEpisodes` (the one
instance), and the generator's episode loop (actors/envs/episodes.py) runs `play` per sample:

1. the prompt as OpenRLHF hands it: the prompt text, rendered by the chat template when the
   generator uses one (`prompt_text`); `sampling_params`: vLLM's `SamplingParams` with the
   generator's settings, `max_tokens` = generator.max_new_tokens, `logprobs=1` (so the behaviour
   log-probs come back); `max_length`: the episode's context limit (generator.max_context_tokens,
   at most generator.max_model_len); `hf_tokenizer`: the engine's tokenizer;
2. each `llm_engine.generate` (`EngineAdapter`) joins the generator's engine batches like a turn of
   an environment episode, sampled with the request's settings (`to_sampling`), and comes back
   shaped like vLLM's `RequestOutput`: `outputs[0].token_ids / .text / .finish_reason / .logprobs`
   (per token a dict {sampled id: Logprob}; only the sampled token's);
3. the returned dict (`parts_of`) becomes the rollout: prompt = `observation_tokens` before the first
   of `action_ranges`, completion = the rest, action mask 1 inside the ranges, behaviour log-probs
   from `rollout_log_probs` (indexed like `observation_tokens`; 0 on the environment's tokens),
   `reward` the rollout's `env_reward` (a scorer of kind `env` scores it), `truncated` its
   finish_reason `length` (else `stop`). Token versions: those of the engine's outputs when the
   ranges hold exactly them, else the oldest version the episode sampled with.

A return that breaks this (a missing key, a range out of bounds or overlapping, a log-prob count
that differs from the token count), an `execute` that raises, or one that outlives
generator.session_timeout_s fails its sample (`EnvFailure`, the message naming the file and the
key), never the generator. `scores` and `extra_logs` travel in the rollout's `env_info` (a scorer of
kind `env` passes them on: dynamic filtering judges the scores, the learner logs the extra logs);
`prompt` and `label` are not carried: a Conveyor rollout has the leased prompt and label.

The one instance serves every lease, but each lease's episodes run on an event loop of their own
(`run_episodes`): an executor that keeps loop-bound objects between calls (an `asyncio.Lock`, an
HTTP session) must make them per call. `images` is always None: the generator reports a prompt
group with images failed rather than hand it to such a file (an environment played by the
generator's own loop takes them: actors/envs/episodes.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
import numbers
from collections import Counter
from dataclasses import dataclass
from typing import Awaitable, Callable

from actors.engines.base import Completion, Sampling
from actors.envs.api import BadReturn, EnvFailure, EnvLoadError, brief, episode_info, flag, number
from actors.envs.openrlhf_agent import AgentExecutorBase, MultiTurnAgentExecutor

EXECUTE_KWARGS = ("prompt", "label", "sampling_params", "max_length", "hf_tokenizer", "llm_engine", "images")
REQUIRED_KEYS = ("observation_tokens", "action_ranges", "rollout_log_probs", "reward")


def own_execute(cls) -> bool:
    """Whether an `AgentExecutor` class drives generation itself (OpenRLHF calls its `execute`)."""
    return (isinstance(cls, type) and issubclass(cls, AgentExecutorBase)
            and cls.execute not in (AgentExecutorBase.execute, MultiTurnAgentExecutor.execute))


def load_executor(cls: type, kwargs: dict, where: str) -> ExecutorEpisodes:
    """`cls(**kwargs)` (OpenRLHF passes none) as the episodes of a generator; errors quote `where`."""
    try:
        inspect.signature(cls.execute).bind(None, **dict.fromkeys(EXECUTE_KWARGS))
    except TypeError:
        raise EnvLoadError(f"{where}: AgentExecutor.execute{inspect.signature(cls.execute)} cannot take OpenRLHF "
                           f"0.11's arguments ({', '.join(EXECUTE_KWARGS)})") from None
    try:
        executor = cls(**kwargs)
    except Exception as e:
        raise EnvLoadError(f"{where}: AgentExecutor({', '.join(kwargs)}) raised {type(e).__name__}: {e}") from None
    return ExecutorEpisodes(executor, where)


# --------------------------------------------------------------------------------------------
# the engine as the file sees it


@dataclass
class SamplingStandIn:
    """vLLM's `SamplingParams` fields that a file reads or sets, where vLLM is not installed."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True


def sampling_params(sampling: Sampling):
    """The `SamplingParams` a file's `execute` is handed: the generator's settings, with log-probs."""
    cls = SamplingStandIn
    if importlib.util.find_spec("vllm") is not None:
        from vllm import SamplingParams as cls
    return cls(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
               max_tokens=sampling.max_tokens, stop=list(sampling.stop) or None,
               stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed, logprobs=1)


def to_sampling(params, room: int) -> Sampling:
    """A request's `SamplingParams` (or anything with its fields) as the engine's `Sampling`, at most
    `room` new tokens (max_tokens None: all of it). vLLM's top_k -1 is 0 here: off."""
    if getattr(params, "n", 1) != 1:
        raise ValueError(f"sampling_params.n={params.n}: one completion per generate call")
    max_tokens = getattr(params, "max_tokens", None)
    stop = getattr(params, "stop", None) or []
    return Sampling(temperature=float(getattr(params, "temperature", 1.0)), top_p=float(getattr(params, "top_p", 1.0)),
                    top_k=max(0, int(getattr(params, "top_k", 0) or 0)),
                    max_tokens=max(1, min(room, room if max_tokens is None else int(max_tokens))),
                    stop_token_ids=[int(t) for t in getattr(params, "stop_token_ids", None) or []],
                    stop=[stop] if isinstance(stop, str) else list(stop), seed=getattr(params, "seed", None))


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """vLLM's `CompletionOutput`, the fields a file reads."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # (T,) {sampled id: its Logprob}; None unless asked for
    finish_reason: str
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """vLLM's `RequestOutput` of one finished request."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt: str | None = None
    finished: bool = True


class EngineAdapter:
    """The `llm_engine` one `execute` call is handed: `generate` samples through the generator's
    batches (`sample(ids, Sampling) -> Completion`) and keeps what each call returned (`calls`, with
    per-token versions) for the rollout."""

    def __init__(self, sample: Callable[[list[int], Sampling], Awaitable[Completion]], limit: int,
                 version: Callable[[], int]):
        self.sample, self.limit, self.version = sample, limit, version
        self.calls: list[tuple[list[int], list[float], list[int]]] = []  # (ids, log-probs, versions) per generate

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None) -> RequestOutput:
        if multi_modal_data:
            raise ValueError("multi_modal_data: images are not supported")
        ids = [int(t) for t in _listed(prompt_token_ids)]
        room = self.limit - len(ids)
        if room < 1:
            raise ValueError(f"a context of {len(ids)} tokens leaves no room under the episode's limit of "
                             f"{self.limit} (generator.max_context_tokens)")
        c = await self.sample(ids, to_sampling(sampling_params, room))
        versions = list(c.versions) if c.versions is not None else [self.version()] * len(c.token_ids)
        self.calls.append((list(c.token_ids), list(c.logprobs), versions))
        want = getattr(sampling_params, "logprobs", None) is not None
        out = CompletionOutput(0, c.text, list(c.token_ids), sum(c.logprobs) if want else None,
                               [{t: Logprob(lp)} for t, lp in zip(c.token_ids, c.logprobs)] if want else None,
                               c.finish_reason, c.stop_reason)
        return RequestOutput(f"conveyor-{len(self.calls)}", ids, [out])


# --------------------------------------------------------------------------------------------
# the returned dict as a rollout's parts


@dataclass
class Played:
    """An episode as `execute` returned it, checked: the rollout's prompt and completion."""

    prompt_ids: list[int]
    ids: list[int]  # the completion: every observation token from the first action on
    mask: list[int]  # (T,) 1 inside action_ranges
    logprobs: list[float]  # (T,) 0 on the environment's tokens
    versions: list[int]  # (T,)
    reward: float | None
    truncated: bool
    info: dict[str, float]  # `scores` and `extra_logs` as Rollout.env_info (actors.envs.api.episode_info)


def parts_of(out, calls: list[tuple[list[int], list[float], list[int]]], version: int, vocab: int | None) -> Played:
    """The rollout's parts from what `execute` returned (OpenRLHF's keys), else BadReturn naming the key.
    `calls`: what each generate returned; `version`: the engine's, for tokens no call accounts for."""
    if not isinstance(out, dict):
        raise BadReturn(f"returned {brief(out)}, expected a dict")
    missing = [k for k in REQUIRED_KEYS if k not in out]
    if missing:
        raise BadReturn(f"returned a dict without {', '.join(map(repr, missing))} (it has {sorted(out)})")
    obs = _token_ids(out["observation_tokens"], vocab, {t for ids, _, _ in calls for t in ids})
    ranges = _ranges(out["action_ranges"], len(obs))
    start = ranges[0][0]
    mask = [0] * len(obs)
    for s, e in ranges:
        mask[s:e] = [1] * (e - s)
    matched = _matched(obs, ranges, calls)
    lps = out["rollout_log_probs"]
    if lps is None:
        if matched is None:
            raise BadReturn("returned 'rollout_log_probs' None, and its 'action_ranges' are not the engine's outputs "
                            "to take them from")
        lps = [0.0] * len(obs)
        for (s, e), (call_lps, _) in zip(ranges, matched):
            lps[s:e] = call_lps
    else:
        lps = _logprobs(lps, obs, mask)
    versions = [min((v for _, _, vs in calls for v in vs), default=version)] * len(obs)
    for (s, e), (_, vs) in zip(ranges, matched or []):
        versions[s:e] = vs
    for i in range(start + 1, len(obs)):
        if not mask[i]:  # the environment's: the version of the policy's turn before it
            versions[i] = versions[i - 1]
    reward = out["reward"]
    behav = [lp if m else 0.0 for lp, m in zip(lps, mask)]
    return Played(obs[:start], obs[start:], mask[start:], behav[start:], versions[start:],
                  None if reward is None else number(reward, "'reward'"),
                  flag(out.get("truncated", False), "'truncated'"),
                  episode_info(out.get("scores"), out.get("extra_logs")))


def _listed(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else x


def _token_ids(x, vocab: int | None, sampled: set[int]) -> list[int]:
    """Token ids: the tokenizer's (0 .. vocab-1), or ones the engine sampled (a model's vocabulary
    may be padded past the tokenizer's)."""
    x = _listed(x)
    if not isinstance(x, (list, tuple)) or not x:
        raise BadReturn(f"returned 'observation_tokens' as {brief(x)}, expected a list of token ids")
    bad = next((t for t in x if isinstance(t, bool) or not isinstance(t, numbers.Integral)
                or t < 0 or (vocab is not None and t >= vocab and t not in sampled)), None)
    if bad is not None:
        raise BadReturn(f"returned 'observation_tokens' holding {brief(bad)}, not a token id"
                        + (f" (0 to {vocab - 1})" if vocab else ""))
    return [int(t) for t in x]


def _ranges(x, n: int) -> list[tuple[int, int]]:
    """Sorted, disjoint (start, end) pairs within the n observation tokens, after a prompt of at least one."""
    x = _listed(x)
    if not isinstance(x, (list, tuple)) or not x:
        raise BadReturn(f"returned 'action_ranges' as {brief(x)}, expected a list of (start, end)")
    out, end = [], 1  # the first action starts after one prompt token at least
    for r in x:
        r = _listed(r)
        if (not isinstance(r, (list, tuple)) or len(r) != 2
                or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in r)):
            raise BadReturn(f"returned 'action_ranges' holding {brief(r)}, expected (start, end) token indices")
        s, e = int(r[0]), int(r[1])
        if not end <= s <= e <= n:
            where = "before a prompt token" if s < 1 else "past the end" if e > n else "overlapping or out of order"
            raise BadReturn(f"returned 'action_ranges' holding ({s}, {e}): {where} (of {n} observation_tokens)")
        out.append((s, e))
        end = e
    if all(s == e for s, e in out):
        raise BadReturn(f"returned 'action_ranges' {brief(x)} that hold no token")
    return out


def _logprobs(x, obs: list[int], mask: list[int]) -> list[float]:
    x = _listed(x)
    if not isinstance(x, (list, tuple)) or len(x) != len(obs):
        size = f"{len(x)} values" if isinstance(x, (list, tuple)) else brief(x)
        raise BadReturn(f"returned 'rollout_log_probs' as {size} for {len(obs)} observation_tokens (one per token)")
    out = []
    for i, (lp, m) in enumerate(zip(x, mask)):
        if not m:
            out.append(0.0)
            continue
        try:
            value = number(lp, f"'rollout_log_probs'[{i}]")
        except BadReturn:
            value = math.nan
        if not value <= 0:
            raise BadReturn(f"returned 'rollout_log_probs'[{i}] {brief(lp)} for an action token: not a log-prob")
        out.append(value)
    return out


def _matched(obs: list[int], ranges, calls) -> list[tuple[list[float], list[int]]] | None:
    """Per range, the (log-probs, versions) of the generate call whose tokens it holds, when the
    non-empty ranges hold exactly the calls' outputs in order; else None."""
    made = iter([c for c in calls if c[0]])
    out = []
    for s, e in ranges:
        if s == e:
            out.append(([], []))
            continue
        ids, lps, vs = next(made, (None, None, None))
        if ids != obs[s:e]:
            return None
        out.append((lps, vs))
    return out if next(made, None) is None else None


# --------------------------------------------------------------------------------------------
# one sample


class ExecutorEpisodes:
    """The file's one `AgentExecutor` instance; `play` runs its `execute` for one sample."""

    def __init__(self, executor, where: str):
        self.executor, self.where = executor, where

    async def play(self, prompt: str, label, sample, tokenizer, sampling: Sampling, limit: int,
                   version: Callable[[], int], timeout_s: float, counts: Counter | None = None) -> Played | EnvFailure:
        engine = EngineAdapter(sample, limit, version)
        what = f"{self.where}: AgentExecutor.execute"
        task = None
        try:
            call = self.executor.execute(prompt=prompt, label=label, sampling_params=sampling_params(sampling),
                                         max_length=limit, hf_tokenizer=tokenizer, llm_engine=engine, images=None)
            task = asyncio.ensure_future(_awaited(call))
            if not (await asyncio.wait({task}, timeout=timeout_s))[0]:
                return _failed("timeout", f"{what} did not return within {timeout_s:g}s "
                                          "(generator.session_timeout_s)", counts)
            vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else None
            return parts_of(task.result(), engine.calls, version(), vocab)
        except BadReturn as e:
            return _failed("bad_return", f"{what} {e}", counts)
        except Exception as e:  # the file's own code: anything may come out of it
            return _failed("raised", f"{what} raised {type(e).__name__}: {e}", counts)
        finally:
            if task is not None:
                task.cancel()  # a no-op once it finished; a timed-out one stops at its next await


async def _awaited(x):
    return await x if inspect.isawaitable(x) else x


def _failed(kind: str, message: str, counts) -> EnvFailure:
    if counts is not None:
        counts[kind] += 1
    return EnvFailure(kind, message)


def prompt_text(tokenizer, prompt: str, messages, use_chat_template: bool) -> str:
    """The prompt as OpenRLHF hands it to `execute`: rendered by the chat template (with the
    generation prompt) when the generator uses one, else the text itself."""
    if not use_chat_template or not getattr(tokenizer, "chat_template", None):
        return prompt
    chat = ([{"role": "user", "content": prompt}] if messages is None
            else [{"role": m.role, "content": m.content} for m in messages])
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
