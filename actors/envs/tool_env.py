"""An environment for tasks answered with tools: each policy turn calls tools or gives the answer.

    generator.env: tools
    generator.env_args:
      tools: [calculator, python]       # or a mapping name -> kwargs: {python: {timeout_s: 2}}
      format: tags                      # the call format of actors/tools/registry.py: hermes (default) or tags
      reward: exact                     # or path/to/file.py[:function] or module:function
      timeout_s: 30                     # any one tool call at most (the registry's backstop)
      max_calls: 8                      # calls run per turn at most; the rest get an error observation

One episode, from a row of the prompt dataset (its prompt is the task, its label the answer):

1. reset keeps the row's prompt as the opening;
2. step(turn): the turn's tool calls are parsed in `format` (`<calc>2+3</calc>`, or hermes'
   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`). Calls: they run (concurrently,
   through the `ToolRegistry`) and their results are the observation, reward 0, not done. No call:
   the turn is the answer; reward = reward(answer, row), done;
3. the generator's `max_turns` ends an episode that never answers (reward 0, counted truncated).

Results are an observation of role `tool`. With the tags format it is the rendered text
(`<result>14</result>`): appended as it is without a chat template (the tiny tokenizer), inside a
tool message with one. With hermes it is the results' text without the outer `<tool_response>`
tags, which the chat templates that take `tools=` (Qwen, Hermes) add to a tool message; several
results in one turn are joined so that such a template renders them as it renders one tool
message per result. So hermes needs such a template; a model without one uses tags.

Nothing a tool does fails the episode: a malformed call, an unknown tool, a tool that raises,
hangs past its limit or prints 10 MB gives an "error: ..." observation (actors/tools/registry.py bounds
them all) and the policy may try again. A reward function that raises fails the episode
(`EnvFailure` "raised", as any environment's error).

Tools: `calculator` (kwargs: Calculator's, e.g. `places`), `python` (kwargs: the sandbox limits
of `actors/tools/sandbox.py`'s SandboxLimits, e.g. `timeout_s`, `memory_mb`), or `file.py:Class` /
`module:Class`, a `actors.tools.registry.Tool` subclass (kwargs: its constructor's). Rewards: `exact` is 1.0
when the answer, stripped of surrounding whitespace, equals the row's label (stripped), else 0.0
(also without a label); a file or module function takes the scorer's reward function signature,
`reward_fn(prompts, completions, labels) -> list[float]` (examples/rewards/*.py), and is called
with the one answer (in a thread: it may block). `env.stop` lists the strings where a turn with a
call is complete (`fmt.stop`), where the generator ends the turn; with hermes, every prompt is
rendered with the tools' schemas as the chat template's `tools=` (`ToolEnvFactory.chat_tools`).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Callable

from actors.envs.api import Environment, EnvLoadError, Row, StepResult
from actors.envs.files import load_object
from actors.rewards import check_rewards
from actors.tools.calculator import Calculator
from actors.tools.formats import make_format
from actors.tools.registry import ERROR, Tool, ToolRegistry, ToolResult
from actors.tools.sandbox import PythonTool, SandboxLimits

Reward = Callable[[str, Row], float]  # (the answer, the row) -> the episode's reward
KEYS = ("tools", "format", "reward", "timeout_s", "max_calls")


def exact_match(answer: str, row: Row) -> float:
    return float(row.label is not None and answer.strip() == row.label.strip())


class ToolEnv(Environment):
    """One episode of a tool-using task (see the module docstring). One registry, format and reward
    serve every episode; an instance holds only its row and counts."""

    observation_role = "tool"

    def __init__(self, registry: ToolRegistry, format: str = "hermes", reward: Reward = exact_match,
                 max_calls: int = 8):
        self.registry, self.fmt, self.reward = registry, make_format(format, registry), reward
        self.max_calls = max_calls
        self.stop, self.tools = self.fmt.stop, registry.schemas()
        self.row: Row | None = None
        self.calls = self.errors = 0

    async def reset(self, row: Row) -> None:
        self.row = row
        return None  # the task as the prompt states it

    async def step(self, action: str) -> StepResult:
        calls = self.fmt.parse(action)
        if not calls:
            reward = await asyncio.to_thread(self.reward, action, self.row)
            return StepResult("", reward, True, {"tool_calls": self.calls, "tool_errors": self.errors})
        results = await self.registry.run_all(calls[:self.max_calls])  # (a python call is a process each)
        results += [ToolResult(c.name, f"{ERROR}more than {self.max_calls} tool calls in one turn; not run", ok=False)
                    for c in calls[self.max_calls:]]
        errors = sum(not r.ok for r in results)
        self.calls, self.errors = self.calls + len(results), self.errors + errors
        return StepResult(self.observation(results), 0.0, False, {"tool_calls": len(results), "tool_errors": errors})

    def observation(self, results: list[ToolResult]) -> str:
        if self.fmt.name == "hermes":  # the template wraps the message in <tool_response> ... </tool_response>
            return "\n</tool_response>\n<tool_response>\n".join(r.text for r in results)
        return self.fmt.render(results)


# --------------------------------------------------------------------------------------------
# from config


def tool_env(kwargs: dict, where: str) -> Callable[[], ToolEnv]:
    """A factory of ToolEnv episodes from generator.env_args (see the module docstring); every
    mistake is said here, at load, quoting `where`."""
    unknown = sorted(set(kwargs) - set(KEYS))
    if unknown:
        raise EnvLoadError(f"{where}: unknown argument(s) {unknown}; the tools environment takes {list(KEYS)}")
    spec = kwargs.get("tools")
    if not spec:
        raise EnvLoadError(f"{where}: needs tools, e.g. env_args: {{tools: [calculator, python]}}")
    named = {name: {} for name in spec} if isinstance(spec, list) else spec
    if not isinstance(named, dict) or not all(isinstance(v, dict) for v in named.values()):
        raise EnvLoadError(f"{where}: tools={spec!r}; expected a list of names or a mapping name -> kwargs")
    try:
        registry = ToolRegistry([make_tool(name, args, where) for name, args in named.items()],
                                timeout_s=kwargs.get("timeout_s", 30.0))
        format = kwargs.get("format", "hermes")
        make_format(format, registry)
    except EnvLoadError:
        raise
    except ValueError as e:  # a tool's tag or sandbox limits the registry or format refuses
        raise EnvLoadError(f"{where}: {e}") from None
    max_calls = kwargs.get("max_calls", 8)
    if not isinstance(max_calls, int) or max_calls < 1:
        raise EnvLoadError(f"{where}: max_calls={max_calls!r}; expected a whole number >= 1")
    return ToolEnvFactory(registry, format, load_reward(kwargs.get("reward", "exact"), where), max_calls)


class ToolEnvFactory:
    """Makes the episodes' ToolEnv; `chat_tools` are the schemas a chat template's `tools=` renders
    into every prompt (hermes only: the tags format is not what such templates describe)."""

    def __init__(self, registry: ToolRegistry, format: str, reward: Reward, max_calls: int):
        self.args = (registry, format, reward, max_calls)
        self.chat_tools = registry.schemas() if format == "hermes" else None

    def __call__(self) -> ToolEnv:
        return ToolEnv(*self.args)


def make_tool(name: str, args: dict[str, Any], where: str) -> Tool:
    """A tool of the registry: `calculator`, `python`, or a Tool subclass named `file.py:Class` / `module:Class`."""
    try:
        if name == "calculator":
            return Calculator(**args)
        if name == "python":
            return PythonTool(SandboxLimits(**args))
        if ":" not in name:
            raise EnvLoadError(f"{where}: unknown tool {name!r}; tools are calculator, python, "
                               "or a Tool subclass as file.py:Class or module:Class")
        cls = load_object(name, where)
        if not (isinstance(cls, type) and issubclass(cls, Tool)):
            raise EnvLoadError(f"{where}: tool {name!r} is not a subclass of actors.tools.registry.Tool")
        return cls(**args)
    except TypeError as e:
        raise EnvLoadError(f"{where}: tool {name!r} cannot take {args}: {e}") from None


def load_reward(spec: str, where: str) -> Reward:
    """`exact`, or the reward function of a file (`reward_fn` unless `file.py:name`) or module (`module:name`)."""
    if spec == "exact":
        return exact_match
    if not isinstance(spec, str):
        raise EnvLoadError(f"{where}: reward={spec!r}; expected 'exact', file.py[:function] or module:function")
    fn = load_object(spec if ":" in spec else f"{spec}:reward_fn", where)
    if not callable(fn):
        raise EnvLoadError(f"{where}: reward {spec!r} is not a function")
    return functools.partial(_call_reward_fn, fn, spec)


def _call_reward_fn(fn, spec: str, answer: str, row: Row) -> float:
    (score,) = check_rewards(fn([row.prompt], [answer], [row.label]), 1, f"reward {spec}")
    if score.value is None:
        raise ValueError(score.error)
    return score.value

