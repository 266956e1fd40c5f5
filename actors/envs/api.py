"""Environments for multi-turn episodes: the API, a guarded way to call one, a loader, OpenRLHF's agents.

An environment is a class; one instance plays one episode. Its two methods (async, or plain
functions that may block: those run in a thread of their own):

    reset(row: Row) -> str | None              the episode's opening: None keeps the row's prompt
                                               (encoded as any prompt is); a string replaces it
    step(action: str) -> StepResult(observation: str, reward: float, done: bool, info: dict,
                                    images: list | None = None)

`action` is the text of the policy's turn; a plain 4-tuple (or 5-tuple, with images) does as well
as a StepResult, so an environment file need not import Conveyor. The episode's reward is the sum
of its steps' rewards. `info` may carry OpenRLHF's `scores` (a number dynamic filtering judges
instead of the reward) and `extra_logs` (named numbers the learner logs as `reward/extra/<name>`):
the episode's are its last step's, carried in `Rollout.env_info` to the scorer of kind `env`
(`episode_info`).

How a generator drives an episode (token ids all the way: text is never re-tokenised):

1. `env = factory()` (from `load_env`), then `opening = await run_reset(env, Row.of(group),
   timeout_s)`; encode the prompt, or `opening` in its place;
2. sample the policy's turn from the ids so far; append its ids (with their behaviour log-probs);
3. `result = await run_step(env, text, timeout_s)`, `text` the turn as the engine decoded it (as
   OpenRLHF passes vLLM's `output.text`); an `EnvFailure` fails the sample;
4. unless `result.done` (or a limit is reached): append `encode_observation(tokenizer,
   result.observation, env.observation_role, ..., images=len(result.images or ()))` (context, no
   loss, no log-probs), and its images; go to 2. (OpenRLHF appends a done step's observation too;
   tokens after the last turn change nothing.)

Observations are text, with images for a vision-language policy: `StepResult.images` (bytes of an
image file, PIL images, base64 text or `data:image/...;base64,` URLs, as `common.images.load_image`
reads them; made encoded bytes) stand where the observation's "<image>" markers are, one marker per
image, in order; an observation with images but no marker gets them all at its start
(`with_markers`). The episode's loop gives the engine each image as one placeholder and expands it
for the rollout (actors/envs/images.py). `Row.images` are the prompt's own.

`observation_role` (a class attribute, `getattr(env, "observation_role", "user")`) says how
observations join the context. `"user"` (or `"tool"`): with a chat template, as a
message of that role followed by the next assistant turn's header, i.e. the ids the template adds
after the model's end-of-turn token, worked out as the difference of two renderings of a stand-in
conversation (`encode_observation`); without a chat template the text itself. `None`: always the
text itself, because it carries its own markup (OpenRLHF's `environment_feedback`, e.g.
"\\n\\nHuman: ...\\n\\nAssistant: ").

`run_reset` and `run_step` never raise: a call that raises, outlives `timeout_s` or returns
what the API does not allow comes back as `EnvFailure(kind, message)`, `kind` one of
`FAILURE_KINDS`, counted in the `counts` Counter when one is given. Other episodes in the event
loop run on meanwhile. An `async` method that blocks (time.sleep, a long computation) stalls the
whole loop and cannot be timed out: write such a method as a plain `def`. A timed-out thread is
abandoned (a thread cannot be killed) and keeps running until it returns.

Naming an environment in config (`load_env(spec, kwargs)`; `kwargs` go to the class):

    guess                          a name of NAMED_ENVS (examples/envs/guess.py's GuessEnv)
    tools                          a task answered with the help of tools (actors/envs/tool_env.py's ToolEnv;
                                   kwargs: tools, format, reward, ...)
    textarena:GuessTheNumber-v0    a single-player TextArena game (actors/envs/arena.py; kwargs go to ta.make)
    path/to/file.py:ClassName      a class in a Python file
    package.module:ClassName       a class in an importable module
    path/to/agent_func.py          an OpenRLHF agent file, as `--train.agent_func_path` takes it

OpenRLHF 0.11 agent files run unchanged and without OpenRLHF: while one is executed, the module
it imports, `openrlhf.utils.agent`, is a stand-in holding `AgentInstanceBase`, `AgentExecutorBase`
and `MultiTurnAgentExecutor`; `OpenRLHFAgent` plays its agent class (actors/envs/openrlhf_agent.py).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Awaitable, Callable, NamedTuple

from actors.prompts import IMAGE_TEXT
from buffer.rollouts import MAX_IMAGE_BYTES, MAX_IMAGES
from common.images import IMAGE, BadImage, ImageLimits, count_images, load_image, text_to_parts

log = logging.getLogger("conveyor.env")

# "refused": not the environment's code but what the episode came to, which the generator cannot
# sample or train on (more images than generator.max_images_per_prompt, an opening whose markers and
# images disagree, a turn that began with an image placeholder); set by the episode's loop
FAILURE_KINDS = ("raised", "timeout", "bad_return", "refused")
MAX_OBSERVATION_CHARS = 1 << 20  # an observation longer than this is a bad return, not context


# --------------------------------------------------------------------------------------------
# the API


@dataclass(frozen=True)
class Row:
    """The prompt an episode starts from, as the buffer leases it."""

    prompt: str  # the prompt's text (a chat prompt: its messages' contents, as the wire carries it)
    label: str | None = None
    messages: list[dict] | None = None  # a chat prompt: [{"role": ..., "content": ...}, ...]
    index: int = 0  # row of the prompt dataset
    images: list[bytes] | None = None  # a vision-language prompt's images (encoded), one per "<image>" in it

    @classmethod
    def of(cls, group) -> Row:
        """The row of a leased `buffer.messages.PromptGroup`."""
        messages = None if group.messages is None else [{"role": m.role, "content": m.content}
                                                         for m in group.messages]
        return cls(group.prompt, group.label, messages, group.index,
                   None if group.images is None else [bytes(b) for b in group.images])


class StepResult(NamedTuple):
    observation: str  # what the environment answers; appended to the context unless done
    reward: float  # this step's reward (the episode's is the sum)
    done: bool  # the episode is over
    info: dict | None = None  # anything for logs (check_step makes None {}); never read by the learner
    # images the observation shows, one per "<image>" marker in it (none: all at its start); check_step
    # makes each encoded bytes (see the module docstring). None: a text observation
    images: list | None = None


class Environment:
    """The base of an environment (optional: any class with `reset` and `step` will do)."""

    observation_role: str | None = "user"  # see the module docstring

    async def reset(self, row: Row) -> str | None:
        return None

    async def step(self, action: str) -> StepResult:
        raise NotImplementedError


@dataclass(frozen=True)
class EnvFailure:
    """Why an episode failed: `kind` one of FAILURE_KINDS; `message` quotes what happened."""

    kind: str
    message: str


class BadReturn(ValueError):
    """An environment returned something the API does not allow (a failure of kind "bad_return")."""


# --------------------------------------------------------------------------------------------
# calling an environment


async def run_reset(env, row: Row, timeout_s: float | None,
                    counts: collections.Counter | None = None) -> str | None | EnvFailure:
    """`env.reset(row)`, or the EnvFailure it came to."""
    return await _guarded(f"{type(env).__name__}.reset", env.reset, row, timeout_s, _check_opening, counts)


async def run_step(env, action: str, timeout_s: float | None,
                   counts: collections.Counter | None = None) -> StepResult | EnvFailure:
    """`env.step(action)` as a checked StepResult, or the EnvFailure it came to."""
    return await _guarded(f"{type(env).__name__}.step", env.step, action, timeout_s, check_step, counts)


def check_step(raw) -> StepResult:
    """`raw` as a StepResult (numbers as floats, flags as bools, info a dict, images as encoded
    bytes with a marker each in the observation), else BadReturn."""
    if not isinstance(raw, tuple) or len(raw) not in (4, 5):
        raise BadReturn(f"returned {brief(raw)}, expected StepResult(observation, reward, done, info[, images])")
    observation, reward, done, info, *images = raw
    check_text(observation, "the observation")
    info = {} if info is None else info
    if not isinstance(info, dict):
        raise BadReturn(f"returned info {brief(info)}, expected a dict")
    if info.get("scores") is not None or info.get("extra_logs"):
        info = {**info, "env_info": episode_info(info.get("scores"), info.get("extra_logs"), "info's ")}
    images = observation_images(images[0] if images else None)
    if images:
        observation = with_markers(observation, len(images))
    return StepResult(observation, number(reward, "the reward"), flag(done, "done"), info, images or None)


# An observation's image: at most what a rollout carries (buffer.rollouts.MAX_IMAGE_BYTES) and as many
# pixels as a prompt's image may have by default (the model's processor then scales it to its own bounds)
OBSERVATION_IMAGES = ImageLimits(MAX_IMAGE_BYTES, 4096 * 4096, MAX_IMAGES, "observation")


def observation_images(raw, what: str = "images") -> list[bytes]:
    """An observation's images (a list of them, or one) as checked encoded bytes, else BadReturn
    naming the bad one; None: []."""
    if raw is None:
        return []
    items = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    if len(items) > OBSERVATION_IMAGES.max_images:
        raise BadReturn(f"returned {len(items)} {what} (at most {OBSERVATION_IMAGES.max_images} in a rollout)")
    out = []
    for i, item in enumerate(items):
        try:
            out.append(load_image(item, OBSERVATION_IMAGES))
        except BadImage as e:
            raise BadReturn(f"returned {what}[{i}] that cannot be used: {e}") from None
    return out


def with_markers(text: str, n: int) -> str:
    """An observation's text with its `n` images marked: as it is when it holds n "<image>" markers,
    with n markers at its start when it holds none; BadReturn otherwise."""
    markers = count_images(text)
    if markers == 0:
        return IMAGE * n + text
    if markers != n:
        raise BadReturn(f"returned an observation with {markers} {IMAGE} marker(s) for its {n} image(s): "
                        f"mark each image where it stands, or none (all at the start)")
    return text


def _check_opening(raw) -> str | None:
    if raw is not None:
        check_text(raw, "reset's opening")
    return raw


async def _guarded(what: str, fn, arg, timeout_s, check, counts):
    task = asyncio.ensure_future(_call(fn, arg))
    task.add_done_callback(retrieve)
    try:
        finished, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not finished:
            return _failed("timeout", f"{what} did not return within {timeout_s:g}s", counts)
        return check(task.result())
    except BadReturn as e:
        return _failed("bad_return", f"{what} {e}", counts)
    except Exception as e:  # the environment's own code: anything may come out of it
        return _failed("raised", f"{what} raised {type(e).__name__}: {e}", counts)
    finally:
        task.cancel()  # a no-op once it finished; cancelling (not awaiting) never hangs on it


async def _call(fn, arg):
    try:
        out = await fn(arg) if inspect.iscoroutinefunction(fn) else await in_thread(fn, arg)
        return await out if inspect.isawaitable(out) else out
    except SystemExit as e:  # would stop the event loop itself if it left this task
        raise RuntimeError(f"SystemExit({e.code!r})") from None


def in_thread(fn, arg) -> asyncio.Future:
    """`fn(arg)` in a daemon thread of its own (one that never returns does not hold up exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():  # else: timed out and cancelled meanwhile
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            ok, value = True, fn(arg)
        except BaseException as e:  # handed to the loop, which decides
            ok, value = False, e
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for this any more
            pass

    threading.Thread(target=work, name=f"env-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


def retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # read, so that a failure after a timeout is not logged as never retrieved


def _failed(kind: str, message: str, counts) -> EnvFailure:
    if counts is not None:
        counts[kind] += 1
    return EnvFailure(kind, message)


def check_text(x, what: str) -> None:
    if not isinstance(x, str):
        raise BadReturn(f"returned {what} as {brief(x)}, expected a str")
    if len(x) > MAX_OBSERVATION_CHARS:
        raise BadReturn(f"returned {what} of {len(x)} characters (at most {MAX_OBSERVATION_CHARS})")


MAX_EXTRA_LOGS = 63  # (+ the score: Rollout.env_info holds at most 64)


def episode_info(scores, extra_logs, what: str = "") -> dict[str, float]:
    """OpenRLHF's `scores` (None: not given) and `extra_logs` of an episode as `Rollout.env_info`:
    {"filter_score": scores, "extra/<name>": value} (buffer.rules' keys, which a scorer of kind `env`
    passes on), each value one finite number (a one-element tensor is its item), else BadReturn."""
    from buffer.rules import EXTRA_LOG_PREFIX, FILTER_SCORE

    out = {} if scores is None else {FILTER_SCORE: number(scores, f"{what}'scores'")}
    if extra_logs is None:
        return out
    if not isinstance(extra_logs, dict):
        raise BadReturn(f"returned {what}'extra_logs' as {brief(extra_logs)}, expected a dict of numbers")
    if len(extra_logs) > MAX_EXTRA_LOGS:
        raise BadReturn(f"returned {len(extra_logs)} {what}'extra_logs' (at most {MAX_EXTRA_LOGS})")
    for k, v in extra_logs.items():
        if not isinstance(k, str) or not 0 < len(k) <= 64:
            raise BadReturn(f"returned an {what}'extra_logs' name {brief(k)}: expected a str of 1-64 characters")
        out[EXTRA_LOG_PREFIX + k] = number(v, f"{what}'extra_logs'[{k!r}]")
    return out


def number(x, what: str) -> float:
    """A finite float from a number or a one-element tensor/array."""
    if hasattr(x, "item") and not isinstance(x, numbers.Number):
        try:
            x = x.item()
        except Exception:
            raise BadReturn(f"returned {what} as {brief(x)}, expected one number") from None
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise BadReturn(f"returned {what} as {brief(x)}, expected a finite number")
    return float(x)


def flag(x, what: str) -> bool:
    try:
        ok = not isinstance(x, str) and x in (True, False)  # bools, numpy/torch bools, 0 and 1
    except Exception:  # a tensor of several elements, say
        ok = False
    if not ok:
        raise BadReturn(f"returned {what} as {brief(x)}, expected a bool")
    return bool(x)


def brief(x) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:80] + '...' if len(text) > 80 else text}"


# --------------------------------------------------------------------------------------------
# observations as token ids


def encode_observation(tokenizer, text: str, role: str | None = "user", *, use_chat_template: bool = True,
                       end_of_turn: str | None = None, images: int = 0) -> list[int]:
    """The ids to append after the policy's turn for an observation (see the module docstring).

    `images`: how many the observation shows (its text holds a "<image>" marker each): each marker
    becomes an image part for the template, or Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`
    in text written as it is; the ids then hold one `<|image_pad|>` per image, unexpanded (the
    caller checks the count: a tokenizer without image tokens holds none).

    With a chat template (and `role`), the turn must have ended with `end_of_turn` (default: the
    tokenizer's eos, e.g. "<|im_end|>"; a turn cut short needs its id appended first); the ids are
    then what the template writes after it: the rest of the assistant message (often "\\n"), the
    observation as a `role` message and the next assistant turn's header. They are encoded from
    that text alone, which starts right after a special token, so they equal the ids of the whole
    conversation rendered and tokenised at once.
    """
    if role is None or not use_chat_template or not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(text.replace(IMAGE, IMAGE_TEXT) if images else text, add_special_tokens=False))
    eot = end_of_turn or tokenizer.eos_token
    mark = "conveyor-stand-in-turn"
    before = [{"role": "user", "content": "u"}, {"role": "assistant", "content": mark}]
    base = tokenizer.apply_chat_template(before, tokenize=False)
    content = text_to_parts(text) if images and IMAGE in text else text
    full = tokenizer.apply_chat_template(before + [{"role": role, "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    if not full.startswith(base):
        raise ValueError("the chat template renders earlier turns differently once a message follows them; "
                         "observations cannot be appended as ids (use observation_role None)")
    cut = base.rfind(eot) if eot else -1
    if cut < base.rfind(mark) + len(mark):
        raise ValueError(f"the chat template does not end an assistant message with {eot!r}: "
                         "pass end_of_turn, the text of the token the policy's turns end with")
    return list(tokenizer.encode(base[cut + len(eot):] + full[len(base):], add_special_tokens=False))


# --------------------------------------------------------------------------------------------
# a text-level episode (evaluation, tests; the generator's loop works on ids)


@dataclass
class Episode:
    reward: float = 0.0  # the sum of the steps' rewards
    turns: int = 0
    done: bool = False  # the environment ended it (else it ran out of turns, or failed)
    failure: EnvFailure | None = None
    context: str = ""  # the opening, then each action and observation, as text
    info: dict = field(default_factory=dict)  # the last step's


async def run_episode(env, row: Row, policy: Callable[[str], Awaitable[str]], *, max_turns: int,
                      timeout_s: float | None, counts: collections.Counter | None = None) -> Episode:
    """Play one episode: `policy(context_text)` writes each turn; observations join as text."""
    ep = Episode()
    opening = await run_reset(env, row, timeout_s, counts)
    if isinstance(opening, EnvFailure):
        ep.failure = opening
        return ep
    ep.context = row.prompt if opening is None else opening
    while ep.turns < max_turns and not ep.done:
        action = await policy(ep.context)
        result = await run_step(env, action, timeout_s, counts)
        ep.turns += 1
        if isinstance(result, EnvFailure):
            ep.failure = result
            break
        ep.reward += result.reward
        ep.done, ep.info = result.done, result.info
        ep.context += action + result.observation
    return ep


class EnvLoadError(ValueError):
    """An environment spec that cannot be used; the message quotes the spec and says why."""
