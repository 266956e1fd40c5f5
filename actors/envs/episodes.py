"""Multi-turn episodes in the generator: the policy writes, an environment answers, the policy
writes again, and the whole episode becomes one rollout.

Every episode of a lease runs as its own coroutine: sample a turn, step the environment (bounded by
`generator.env_timeout_s`), append the observation, again. Turns waiting to be sampled go to the
engine together (`Batcher`: one batch at a time, in a worker thread, while the event loop steps
the environments), so a slow environment holds back its own episode only. The context
is token ids from start to end: the policy's ids as the engine sampled them (with their behaviour
log-probs and versions) and the environment's ids as `actors.envs.api.encode_observation` encodes its
observation, never a re-tokenisation of the text so far. The rollout's completion is every id after
the prompt; `action_mask` says which the policy sampled (1) and which the environment added (0,
behaviour log-prob 0, the version of the policy's turn before them).

A turn ends at the tokenizer's eos, a stop token, or a stop string of the environment's (`env.stop`,
e.g. `</calc>` of the tools' tags format, kept in the turn); with a chat template, a turn that did
not end with the template's end-of-turn token gets it appended as the environment's.

Limits: `generator.max_turns` policy turns, `generator.max_new_tokens` per turn, and
`generator.max_context_tokens` in all (prompt and completion; 0: prompt_max_len + max_turns x
max_new_tokens); an episode that reaches one ends with finish_reason `length` (counted as
truncated). One that ends because its environment said done ends with `stop`. The episode's reward
(the sum of its steps' rewards) travels as `Rollout.env_reward`; a scorer with kind `env` makes it a
reward component.

An environment that raises, outlives its timeout or returns what the API does not allow fails its
episode (`actors.envs.api.EnvFailure`, counted by kind); as with a prompt refused, the episode's group is
given up (the buffer takes a group whole), never the generator.

A vision-language policy's episode may hold images: its prompt's, and those its environment's
observations show (`StepResult.images`, at most `generator.max_images_per_prompt` in all: each
turn's request holds every image so far, and that is the engine's limit per request; past it the
episode fails, kind `refused`). The engine is given each image as its one placeholder; the rollout
holds them expanded to the image's tokens, an observation's placeholders among the environment's
tokens (mask 0), and `Rollout.images` the prompt's images then the observations', in order
(actors/envs/images.py has the two views).

An OpenRLHF file whose `AgentExecutor` has its own `execute` (`factory` is then an
`actors.envs.agent_executor.ExecutorEpisodes`) plays each episode itself: its engine calls join
the same batches, and what it returns becomes the episode (see that module).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from actors.engines.base import Completion, Engine, Sampling
from actors.envs.agent_executor import ExecutorEpisodes, Played, prompt_text
from actors.envs.api import EnvFailure, Row, encode_observation, run_reset, run_step
from actors.envs.images import first_difference, image_tokens
from actors.prompts import IMAGE_PAD, PromptRefused, encode_prompt
from buffer.messages import ID_DTYPE, LOGPROB_DTYPE, PromptGroup, Rollout
from common.wire import MASK_DTYPE

log = logging.getLogger("conveyor.generator")


@dataclass
class Episode:
    group: PromptGroup
    sample_index: int
    env: object
    prompt_ids: list[int]  # the rollout's prompt (with images: each expanded to its tokens)
    ids: list[int] = field(default_factory=list)  # the completion so far: the policy's and the environment's
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finish: str = ""  # "" while it runs; "stop" | "length"
    failure: EnvFailure | None = None
    info: dict[str, float] = field(default_factory=dict)  # Rollout.env_info: the last step's scores and extra logs
    images: list[bytes] = field(default_factory=list)  # the prompt's, then the observations', in placeholder order
    # the engine's view (actors/envs/images.py): the prompt and the completion with one placeholder
    # per image; None / equal to prompt_ids and ids for an episode without images
    engine_prompt: list[int] | None = None
    engine_ids: list[int] = field(default_factory=list)

    def add(self, ids, mask: int, logprobs=None, versions=None, text: str = "", engine_ids=None) -> None:
        """Append ids (the rollout's view); `engine_ids`: the same as the engine is given them, when
        they differ (an observation's images unexpanded)."""
        self.ids += ids
        self.engine_ids += ids if engine_ids is None else engine_ids
        self.mask += [mask] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        last = self.versions[-1] if self.versions else 0
        self.versions += list(versions) if versions is not None else [last] * len(ids)
        self.texts.append(text)

    def context(self) -> list[int]:
        """The ids the engine is given for the next turn."""
        return (self.prompt_ids if self.engine_prompt is None else self.engine_prompt) + self.engine_ids

    def refuse(self, why: str, counts: Counter) -> None:
        self.failure = EnvFailure("refused", why)
        counts["refused"] += 1


def context_limit(cfg) -> int:
    return cfg.max_context_tokens or cfg.prompt_max_len + cfg.max_turns * cfg.max_new_tokens


def close_turn(tokenizer, turn_ids: list[int], role: str | None, use_chat_template: bool) -> list[int]:
    """The end-of-turn id a chat template writes after an assistant message, when the policy's turn
    did not sample it (a stop string, or the token limit, ended the turn): appended as the
    environment's (masked), so the context stays the conversation's ids. [] without a template."""
    if role is None or not use_chat_template or not getattr(tokenizer, "chat_template", None):
        return []
    eot = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    return [] if turn_ids and turn_ids[-1] == eot else [eot]


def run_episodes(groups: list[PromptGroup], prompt_ids: list[list[int]], n: int, engine: Engine,
                 sampling: Sampling, cfg, factory, generate, counts: Counter) -> dict[int, list[Episode]]:
    """Every episode of the lease's groups (n per prompt), played to its end: {group_id: episodes}.
    `generate(contexts, sampling)` samples one completion per context (the engine's batch)."""
    return asyncio.run(_play(groups, prompt_ids, n, engine, sampling, cfg, factory, generate, counts))


class Batcher:
    """The engine's batches for episodes that each go at their own pace: a turn waiting to be
    sampled joins the next batch (contexts of the same sampling settings go together), which runs
    in a worker thread while the event loop keeps stepping environments. So a slow environment
    holds back its own episode, not the others, and the engine is never asked twice at once.

    Turns that differ only in max_tokens (each episode's room under the context limit) go together,
    sampled with the largest and each cut to its own (`cut`): sampling is token by token, so the
    first k tokens of a longer sample are a sample of k tokens."""

    def __init__(self, generate, tokenizer=None):
        self.generate, self.tokenizer = generate, tokenizer
        self.waiting: list[tuple[list[int], Sampling, asyncio.Future, list[bytes] | None]] = []
        self.wake = asyncio.Event()
        self.batches = 0

    async def sample(self, context: list[int], sampling: Sampling, images: list[bytes] | None = None):
        """One completion of `context`; `images`: the context's, one placeholder each in it (a batch
        with images calls `generate(contexts, sampling, images)`, a text batch `generate(contexts, sampling)`)."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((context, sampling, fut, images or None))
        self.wake.set()
        return await fut

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wake.wait()
            self.wake.clear()
            await asyncio.sleep(0)  # (every episode ready now joins this batch)
            batch, self.waiting = self.waiting, []
            by_sampling: dict[tuple, list] = {}
            for item in batch:
                s = item[1]
                key = (s.temperature, s.top_p, s.top_k, tuple(s.stop), tuple(s.stop_token_ids), s.seed)
                by_sampling.setdefault(key if self.tokenizer is not None else (s.max_tokens, *key), []).append(item)
            for items in by_sampling.values():
                most = replace(items[0][1], max_tokens=max(s.max_tokens for _, s, _, _ in items))
                images = [i for _, _, _, i in items]
                args = ([c for c, _, _, _ in items], most) + ((images,) if any(images) else ())
                try:
                    out = await loop.run_in_executor(None, self.generate, *args)
                except Exception as e:  # (the engine refused a context: every episode of the batch hears it)
                    for _, _, fut, _ in items:
                        if not fut.done():  # (else: its episode was cancelled meanwhile)
                            fut.set_exception(e)
                    continue
                self.batches += 1
                for (_, s, fut, _), c in zip(items, out):
                    if not fut.done():
                        fut.set_result(cut(c, s.max_tokens, self.tokenizer))


def cut(c: Completion, max_tokens: int, tokenizer) -> Completion:
    """A completion sampled with a larger max_tokens as the one sampled with `max_tokens`: its first
    tokens, ended by the length limit. (Had one of them ended it, the sample would have stopped there.)"""
    if len(c.token_ids) <= max_tokens:
        return c
    ids = c.token_ids[:max_tokens]
    return Completion(ids, c.logprobs[:max_tokens], "length", tokenizer.decode(ids, skip_special_tokens=True),
                      None if c.versions is None else c.versions[:max_tokens], prompt_ids=c.prompt_ids)


def before_placeholder(c: Completion, placeholders: set[int], tokenizer) -> Completion:
    """A vision-language policy's turn ended before the first image (or video) placeholder it
    sampled: the model's forward gives every placeholder an image's features, and the next turn's
    engine would look for an image for it (as `actors.generator.before_placeholder`)."""
    at = next((t for t, tok in enumerate(c.token_ids) if tok in placeholders), None)
    return c if at is None else cut(c, at, tokenizer)


async def _play(groups, prompt_ids, n, engine, sampling, cfg, factory, generate, counts):
    tok = engine.tokenizer
    executor = factory if isinstance(factory, ExecutorEpisodes) else None
    episodes = [Episode(g, j, None if executor else factory(), list(ids))
                for g, ids in zip(groups, prompt_ids) for j in range(n)]
    limit = context_limit(cfg)
    batcher = Batcher(generate, tok)
    placeholders = set(getattr(engine, "placeholder_ids", ()))  # (none: a text policy)

    # the file's execute plays the whole episode, within OpenRLHF's max_length: at most what the engine holds
    max_length = min(limit, cfg.max_model_len) if cfg.max_model_len else limit

    async def execute(e: Episode) -> None:
        if e.group.images:  # (the generator refuses such groups; this for a caller of run_episodes)
            return e.refuse("an AgentExecutor with its own execute takes text prompts only", counts)
        out = await executor.play(prompt_text(tok, e.group.prompt, e.group.messages, cfg.use_chat_template),
                                  e.group.label, batcher.sample, tok, sampling, max_length, lambda: engine.version,
                                  cfg.session_timeout_s, counts)
        if isinstance(out, EnvFailure):
            e.failure = out
            return
        fill(e, out, tok)
        counts["episodes_truncated"] += out.truncated

    async def play(e: Episode) -> None:
        opening = await run_reset(e.env, Row.of(e.group), cfg.env_timeout_s, counts)
        if isinstance(opening, EnvFailure):
            e.failure = opening
            return
        if opening is not None:  # the environment's own opening replaces the prompt, encoded as a prompt is
            try:  # (with the prompt's images: one "<image>" marker each in the opening)
                e.prompt_ids = encode_prompt(tok, opening, cfg.use_chat_template, images=e.group.images)
            except PromptRefused as err:
                return e.refuse(f"reset's opening: {err}", counts)
        if e.group.images:
            e.images, e.engine_prompt = [bytes(b) for b in e.group.images], e.prompt_ids
            e.prompt_ids = image_tokens(cfg.model).expand(e.engine_prompt, e.images)
        role = getattr(e.env, "observation_role", "user")
        turn = replace(sampling, stop=[*sampling.stop, *getattr(e.env, "stop", ())])
        while True:
            room = limit - len(e.prompt_ids) - len(e.ids)
            c = await batcher.sample(e.context(), replace(turn, max_tokens=max(1, min(turn.max_tokens, room))),
                                     list(e.images))
            if e.images and (why := _expanded_differently(e, c)):
                return e.refuse(why, counts)
            if placeholders:
                c = before_placeholder(c, placeholders, tok)
                if not c.token_ids:
                    return e.refuse("a turn began with an image placeholder token, which the learner's forward "
                                    "cannot take without an image", counts)
            e.add(c.token_ids, 1, c.logprobs,
                  c.versions if c.versions is not None else [engine.version] * len(c.token_ids), c.text)
            e.turns += 1
            res = await run_step(e.env, c.text, cfg.env_timeout_s, counts)
            if isinstance(res, EnvFailure):
                e.failure = res  # (counted by kind in `counts` by run_step)
                return
            e.reward += float(res.reward)
            e.info = (res.info or {}).get("env_info", {})  # (an OpenRLHF agent's; the last step's, as there)
            if res.done:
                e.finish = "stop"
                return
            new = res.images or []
            obs = close_turn(tok, c.token_ids, role, cfg.use_chat_template)
            obs += encode_observation(tok, res.observation, role, use_chat_template=cfg.use_chat_template,
                                      images=len(new))
            expanded = obs
            if (new or placeholders) and e.turns < cfg.max_turns:
                if why := _observation_refused(obs, new, len(e.images), placeholders, cfg.max_images_per_prompt):
                    return e.refuse(why, counts)
                expanded = image_tokens(cfg.model).expand(obs, new) if new else obs
            if e.turns >= cfg.max_turns or len(e.prompt_ids) + len(e.ids) + len(expanded) >= limit:
                e.finish = "length"  # a turn limit or the context limit: truncated, as a long completion is
                counts["episodes_truncated"] += 1
                return
            e.add(list(expanded), 0, text=res.observation, engine_ids=list(obs))
            e.images += new

    server = asyncio.create_task(batcher.serve())
    try:
        await asyncio.gather(*((execute if executor else play)(e) for e in episodes))
    finally:
        server.cancel()
    counts["episodes_failed"] += sum(e.failure is not None for e in episodes)
    counts["engine_batches"] += batcher.batches
    return {g.group_id: [e for e in episodes if e.group.group_id == g.group_id] for g in groups}


def _expanded_differently(e: Episode, c: Completion) -> str:
    """Why the engine's expansion of an episode's context is not the rollout's view so far ("": it is)."""
    if c.prompt_ids is None:
        return "the engine gave no expanded prompt ids for a context with images"
    ours = e.prompt_ids + e.ids
    at = first_difference(c.prompt_ids, ours)
    if at is None:
        return ""
    return (f"the engine expanded the context's {len(e.images)} image(s) to {len(c.prompt_ids)} ids, the model's "
            f"image processor to {len(ours)} (they differ from position {at} on)")


def _observation_refused(obs: list[int], images: list[bytes], before: int, placeholders: set[int],
                         max_images: int) -> str:
    """Why an observation's ids and images cannot join the episode ("": they can): a text policy,
    placeholders that are not its images', or more images in the episode than the engine takes."""
    if images and not placeholders:
        return (f"an observation with {len(images)} image(s), but the policy is a text model "
                f"(its engine takes no images)")
    held = sum(1 for t in obs if t in placeholders)
    if held != len(images):
        return (f"the observation's ids hold {held} image placeholder(s) ({IMAGE_PAD}) for its {len(images)} "
                f"image(s): a placeholder written in its text, or a tokenizer without image tokens")
    if before + len(images) > max_images:
        return (f"{before + len(images)} images in the episode (the prompt's and the observations') > "
                f"generator.max_images_per_prompt={max_images}, the images one engine request may hold")
    return ""


def fill(e: Episode, out: Played, tokenizer) -> None:
    """The episode an executor played, as the generator's own loop would have left it."""
    e.prompt_ids, e.ids, e.mask, e.logprobs, e.versions = out.prompt_ids, out.ids, out.mask, out.logprobs, out.versions
    e.texts = [tokenizer.decode(out.ids, skip_special_tokens=True)]
    e.reward, e.turns = out.reward, sum(1 for i, m in enumerate(out.mask) if m and (i == 0 or not out.mask[i - 1]))
    e.finish = "length" if out.truncated else "stop"
    e.info = out.info


def rollout_of(e: Episode, lease_id: int, worker_id: str) -> Rollout:
    """The episode as one rollout: the prompt, then every turn's ids, the policy's marked in the mask."""
    return Rollout(
        group_id=e.group.group_id, sample_index=e.sample_index, lease_id=lease_id,
        prompt_ids=np.asarray(e.prompt_ids, dtype=ID_DTYPE), completion_ids=np.asarray(e.ids, dtype=ID_DTYPE),
        behav_logprobs=np.asarray(e.logprobs, dtype=LOGPROB_DTYPE), versions=np.asarray(e.versions, dtype=ID_DTYPE),
        prompt=e.group.prompt, completion="".join(e.texts), label=e.group.label, finish_reason=e.finish,
        worker_id=worker_id, action_mask=np.asarray(e.mask, dtype=MASK_DTYPE), env_reward=e.reward,
        env_info=e.info, columns=e.group.columns, images=e.images or None)
