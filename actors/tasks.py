"""Several tasks in one run: each prompt row names its task, and the task names its reward.

    scorer:
      task_key: data_source            # the dataset column naming a row's task (default `task`)
      tasks: {math: math, code: code, game: env}    # task -> reward file, built-in, or `env` (its episode's)
      task_options: {code: {mode: all}}                          # each task's configure() options
      reward_fn: format                # optional: the reward of a row whose task is not in `tasks`

`TaskRewards` is then the scorer's `reward_fn` component: one reward-function worker per task
(actors/reward_files.py: its own process, timeout and restarts, so a slow verifier stalls only its
own task's samples' call), each called once per message with its task's samples, the answers put
back in order. A row without a task, or with one `tasks` does not name and no `reward_fn` default,
fails its sample with the reason (the buffer drops its group and counts it). The generator's side
is `TaskEnvs`: each row's task may name the environment its samples play (generator.task_envs),
scored by `env` here. The task travels in the sample's metadata (`buffer.rules.TASK`), from which the
learner logs `task/<name>/...` per step (reward mean, pass rate: the share of samples with a reward
above 0, completion length, the task's share of the samples) and the evaluation its
`eval/<name>/...` (buffer/eval.py).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Sequence

from actors.reward_files import RewardFn
from actors.rewards import EnvReward, Score

if TYPE_CHECKING:
    from buffer.messages import Rollout


def task_of(columns: str, key: str) -> str | None:
    """The task a prompt row names in column `key` (a string or a number; `columns`: the row's other
    columns as JSON, `Rollout.columns` or `PromptGroup.columns`), else None."""
    if not columns:
        return None
    value = json.loads(columns).get(key)
    return None if value is None or isinstance(value, (dict, list)) else str(value)


class TaskEnvs:
    """The generator's environments by task (generator.task_envs): each prompt group plays the
    environment its row's task names, a group of any other task `default` (generator.env; None: one
    completion per sample). A lease's groups are split by environment and each part generated as a
    lease of its own would be."""

    def __init__(self, factories: dict, key: str, default=None):
        self.factories, self.key, self.default = factories, key, default

    def of(self, group):
        return self.factories.get(task_of(group.columns, self.key), self.default)

    def split(self, grant, generate) -> list:
        """`generate(part, factory)` for each part of `grant` (its groups with one environment); the rollouts."""
        from msgspec.structs import replace

        parts: dict[int, tuple] = {}
        for g in grant.groups:
            f = self.of(g)
            parts.setdefault(id(f), (f, []))[1].append(g)
        return [r for f, groups in parts.values() for r in generate(replace(grant, groups=groups), f)]


class TaskRewards:
    """Each sample scored by its task's reward function (see the module docstring)."""

    name = "reward_fn"

    def __init__(self, tasks: dict[str, str], key: str, default: str = "", timeout_s: float = 60.0,
                 tokenizer=None, options: dict[str, dict] | None = None, default_options: dict | None = None):
        options = options or {}
        self.key = key
        self.fns: dict[str, RewardFn | EnvReward] = {}
        self.default: RewardFn | None = None
        try:
            for task, path in tasks.items():  # ("env": the episode's own reward, generator.task_envs)
                self.fns[task] = (EnvReward() if path == "env"
                                  else RewardFn(path, timeout_s, tokenizer, options.get(task)))
            self.default = RewardFn(default, timeout_s, tokenizer, default_options) if default else None
        except BaseException:
            self.close()
            raise
        self.signature = "tasks"

    @property
    def timeouts(self) -> int:
        return sum(f.timeouts for f in self.all())

    @property
    def crashes(self) -> int:
        return sum(f.crashes for f in self.all())

    def all(self) -> list[RewardFn]:
        """The reward-function workers (an `env` task has none)."""
        return [f for f in [*self.fns.values(), self.default] if isinstance(f, RewardFn)]

    def close(self) -> None:
        for f in self.all():
            f.close()

    def score(self, rollouts: Sequence[Rollout]) -> list[Score]:
        out: list[Score | None] = [None] * len(rollouts)
        by_fn: dict[int, tuple[RewardFn, list[int]]] = {}
        for i, r in enumerate(rollouts):
            task = task_of(r.columns, self.key)
            fn = self.fns.get(task) if task is not None else None
            fn = fn or self.default
            if fn is None:
                known = ", ".join(sorted(self.fns))
                out[i] = Score(None, f"the row's task {task!r} (column {self.key!r}) has no reward: scorer.tasks "
                                     f"names {known}, and scorer.reward_fn (the default) is empty")
                continue
            by_fn.setdefault(id(fn), (fn, []))[1].append(i)
        for fn, idx in by_fn.values():
            for i, s in zip(idx, fn.score([rollouts[i] for i in idx])):
                out[i] = s
        return out  # type: ignore[return-value]
