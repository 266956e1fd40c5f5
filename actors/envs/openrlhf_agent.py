"""OpenRLHF 0.11 agent files, run unchanged and without OpenRLHF installed.

Such a file imports `openrlhf.utils.agent`; while `actors.envs.loader.load_env` executes it, that module is
a stand-in (`openrlhf_standin`) holding this file's `AgentInstanceBase`, `AgentExecutorBase` and
`MultiTurnAgentExecutor`. OpenRLHF takes the agent class from the file's `AgentExecutor` (its
`agent_instance_cls`); `OpenRLHFAgent` plays that class as a Conveyor `Environment`, feeding it
the states OpenRLHF feeds it and passing on what it returns (`rewards`, `scores`,
`environment_feedback`, `done`, `extra_logs`) as OpenRLHF uses them. A file whose `AgentExecutor`
has an `execute` of its own drives the engine itself: actors/envs/agent_executor.py runs it.
"""

from __future__ import annotations

import abc
import copy
import inspect
import logging
import sys
import types
from contextlib import contextmanager

from actors.answers import extract_boxed_answer, get_tokenizer, grade_answer
from actors.envs.api import (
    BadReturn,
    Environment,
    EnvLoadError,
    Row,
    StepResult,
    brief,
    check_text,
    flag,
    number,
    observation_images,
)
from actors.prompts import IMAGE_TEXT
from common.images import IMAGE

log = logging.getLogger("conveyor.env")


class AgentInstanceBase(abc.ABC):
    """OpenRLHF's base of an agent instance: one per episode, `reset` then `step` per turn."""

    @abc.abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abc.abstractmethod
    async def step(self, state_dict: dict, **kwargs):
        raise NotImplementedError


class AgentExecutorBase(abc.ABC):
    """OpenRLHF's base of an executor, which runs a whole episode against its engine; a file's own
    `execute` is run by actors/envs/agent_executor.py."""

    @abc.abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        raise NotImplementedError


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's multi-turn executor. Mostly it only names the agent class, which `OpenRLHFAgent`
    plays in the generator's own loop; a subclass whose `execute` calls this one gets OpenRLHF's
    loop against the engine it is handed (the agent's turns until it says done or `max_length`
    tokens are used; the feedback tokenised alone and appended; OpenRLHF's dict)."""

    def __init__(self, agent_instance_cls):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"{agent_instance_cls!r} must inherit from AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        if images:
            raise ValueError("images are not supported")
        agent = await new_agent(self.agent_instance_cls, {})
        text = (await _maybe_await(agent.reset({"observation": prompt, "label": label})))["observation"]
        tokens = list(hf_tokenizer(text=text, add_special_tokens=False)["input_ids"])
        keep = max_length - (getattr(sampling_params, "max_tokens", None) or 1)  # room for one turn at least
        if len(tokens) > keep:  # the opening's tail, as OpenRLHF keeps it
            tokens = tokens[-keep:] if keep > 0 else []
            text = hf_tokenizer.decode(tokens, skip_special_tokens=False)
        want_logprobs = sampling_params.logprobs is not None
        logprobs = [0.0] * len(tokens)
        ranges, reward, scores, extra_logs, truncated = [], 0.0, 0.0, {}, False
        while max_length - len(tokens) > 0:
            sampling_params.max_tokens = max_length - len(tokens)
            output = (await llm_engine.generate(tokens, copy.deepcopy(sampling_params))).outputs[0]
            action = list(output.token_ids)
            truncated = output.finish_reason == "length"
            ranges.append((len(tokens), len(tokens) + len(action)))
            out = await _maybe_await(agent.step({"observation_text": text, "action_text": output.text, "label": label,
                                                 "sampling_params": sampling_params}))
            reward += number(out["rewards"], "rewards")
            scores, extra_logs = out.get("scores", reward), out.get("extra_logs", {})
            feedback = list(hf_tokenizer(text=out["environment_feedback"], add_special_tokens=False)["input_ids"])
            text += output.text + out["environment_feedback"]
            if want_logprobs:
                logprobs += [step[t].logprob for t, step in zip(action, output.logprobs)] + [0.0] * len(feedback)
            tokens += action + feedback
            sampling_params = out.get("sampling_params") or sampling_params
            if out["done"]:
                break
        return {"prompt": prompt, "label": label, "images": images, "mm_train_inputs": None, "reward": reward,
                "scores": scores, "observation_tokens": tokens, "action_ranges": ranges,
                "rollout_log_probs": logprobs if want_logprobs else None, "truncated": truncated,
                "extra_logs": extra_logs}


async def new_agent(cls: type, kwargs: dict):
    """`cls(**kwargs)`, awaiting an `async def __init__` (as OpenRLHF's README writes one)."""
    if not inspect.iscoroutinefunction(cls.__init__):
        return cls(**kwargs)
    agent = cls.__new__(cls)
    await agent.__init__(**kwargs)
    return agent


@contextmanager
def openrlhf_standin():
    """OpenRLHF's modules that agent and reward files import, in sys.modules while such a file is
    executed: `openrlhf.utils` (`extract_boxed_answer`, `grade_answer`, `get_tokenizer`: see
    actors/answers.py), `.agent`, `.math_utils` and `.logging_utils`."""
    names = ("openrlhf", "openrlhf.utils", "openrlhf.utils.agent", "openrlhf.utils.logging_utils",
             "openrlhf.utils.math_utils")
    saved = {n: sys.modules.get(n) for n in names}
    root, utils, agent, logs, maths = (types.ModuleType(n) for n in names)
    root.utils, utils.agent, utils.logging_utils, utils.math_utils = utils, agent, logs, maths
    agent.AgentInstanceBase, agent.AgentExecutorBase = AgentInstanceBase, AgentExecutorBase
    agent.MultiTurnAgentExecutor = MultiTurnAgentExecutor
    logs.init_logger = logging.getLogger
    for module in (utils, maths):
        module.extract_boxed_answer, module.grade_answer = extract_boxed_answer, grade_answer
    utils.get_tokenizer = get_tokenizer
    sys.modules.update(zip(names, (root, utils, agent, logs, maths)))
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def agent_class(module: types.ModuleType, where: str) -> type:
    """The agent class of an OpenRLHF agent file: `AgentExecutor().agent_instance_cls`, else
    `AgentInstance`. (A file whose `AgentExecutor` has its own `execute` drives generation itself:
    actors/envs/agent_executor.py runs it, and the loader never asks for its agent class.)"""
    executor = getattr(module, "AgentExecutor", None)
    if isinstance(executor, type) and issubclass(executor, MultiTurnAgentExecutor):
        try:
            return executor().agent_instance_cls
        except Exception as e:
            raise EnvLoadError(f"{where}: AgentExecutor() raised {type(e).__name__}: {e}") from None
    cls = getattr(module, "AgentInstance", None)
    if isinstance(cls, type) and issubclass(cls, AgentInstanceBase):
        if executor is not None:
            log.warning("%s: AgentExecutor is not a MultiTurnAgentExecutor; playing AgentInstance", where)
        return cls
    raise EnvLoadError(f"{where}: an OpenRLHF agent file must define `AgentExecutor(MultiTurnAgentExecutor)`, "
                       "`AgentExecutor(AgentExecutorBase)` with its own execute, or "
                       "`AgentInstance(AgentInstanceBase)`; to load another class, name it: file.py:ClassName")


class OpenRLHFAgent(Environment):
    """An OpenRLHF agent class played as OpenRLHF's MultiTurnAgentExecutor plays it.

    One instance per episode; `reset({"observation": prompt, "label": label})` returns
    `{"observation": text}`; each `step` gets `{"observation_text": the text before this action
    (the opening, then each action and feedback), "action_text", "label", "sampling_params"}` and
    returns `rewards` (summed over the episode), `environment_feedback` (appended as text), `done`,
    and optionally `scores` (the episode's score for dynamic filtering: the last step's, else the
    reward so far), `extra_logs` and `sampling_params` (passed on in `info`; the generator may set
    `sampling_params` to what the agent should see), and `environment_images` (a vision-language
    policy's: images the feedback shows, as bytes, PIL images or base64, each written in the
    feedback as Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>` as OpenRLHF's example
    writes it, or as "<image>"; none written: all at the feedback's start). With a chat template, OpenRLHF's observation
    text would hold the rendered prompt where this holds the plain one. An `async def __init__` (as
    OpenRLHF's README writes one) is awaited.
    """

    observation_role = None  # environment_feedback is appended as text, as OpenRLHF does

    def __init__(self, agent_cls: type, kwargs: dict | None = None, sampling_params=None):
        self.agent_cls, self.kwargs, self.sampling_params = agent_cls, dict(kwargs or {}), sampling_params
        self.agent = None
        self.label: str | None = None
        self.observation_text = ""  # the opening, then every action and feedback so far
        self.total_reward = 0.0

    async def reset(self, row: Row) -> str | None:
        self.agent = await new_agent(self.agent_cls, self.kwargs)
        out = await _maybe_await(self.agent.reset({"observation": row.prompt, "label": row.label}))
        if not isinstance(out, dict) or not isinstance(out.get("observation"), str):
            raise BadReturn(f"returned {brief(out)}, expected {{'observation': str}}")
        self.label, self.observation_text, self.total_reward = row.label, out["observation"], 0.0
        return None if out["observation"] == row.prompt else out["observation"]

    async def step(self, action: str) -> StepResult:
        states = {"observation_text": self.observation_text, "action_text": action, "label": self.label,
                  "sampling_params": self.sampling_params}
        out = await _maybe_await(self.agent.step(states))
        if not isinstance(out, dict):
            raise BadReturn(f"returned {brief(out)}, expected a dict")
        missing = [k for k in ("rewards", "environment_feedback", "done") if k not in out]
        if missing:
            raise BadReturn(f"returned a dict without {', '.join(map(repr, missing))} (it has {sorted(out)})")
        feedback, reward = out["environment_feedback"], number(out["rewards"], "rewards")
        check_text(feedback, "environment_feedback")
        images = observation_images(out.get("environment_images"), "'environment_images'")
        if images:  # OpenRLHF's feedback writes each image as the model's own placeholder text
            feedback = feedback.replace(IMAGE_TEXT, IMAGE)
        self.total_reward += reward
        scores = out.get("scores", self.total_reward)
        extra_logs = out.get("extra_logs") or {}
        extra_logs = {k: _plain(v) for k, v in extra_logs.items()} if isinstance(extra_logs, dict) else extra_logs
        # (check_step turns them into the rollout's env_info; the episode keeps its last step's, as OpenRLHF)
        info = {"scores": None if scores is None else number(_plain(scores), "scores"), "extra_logs": extra_logs}
        if out.get("sampling_params") is not None:
            info["sampling_params"] = out["sampling_params"]  # OpenRLHF samples the next turn with them
        self.observation_text += action + out["environment_feedback"]
        return StepResult(feedback, reward, flag(out["done"], "done"), info, images or None)


async def _maybe_await(x):
    return await x if inspect.isawaitable(x) else x


def _plain(x):
    """An extra_logs value as OpenRLHF logs it: a tensor's first element as a number."""
    return x.flatten()[0].item() if hasattr(x, "flatten") and hasattr(x, "item") else x
