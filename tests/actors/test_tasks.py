"""Several tasks in one run (actors/tasks.py): each row's task column picks its reward function, the
task reaches the sample's metadata, and the learner and the evaluation report per task."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from actors.config import ScorerConfig
from actors.scorer import Scorer
from actors.tasks import task_of
from common.config import ConfigError
from tests.helpers.scoring import make_rollout

EXACT = ("def reward_fn(prompts, completions, labels):\n"
         "    return [float(c.strip() == l) for c, l in zip(completions, labels)]\n")
LENGTH = "def reward_fn(prompts, completions, labels):\n    return [len(c) / 10 for c in completions]\n"


def rollout(i: int, completion: str, label: str, task) -> object:
    r = make_rollout(f"p{i}", completion, label, group_id=i)
    r.columns = json.dumps({"task": task, "level": i}) if task is not None else ""
    return r


def test_each_rows_task_picks_its_reward_and_is_in_its_metadata(tmp_path):
    (tmp_path / "exact.py").write_text(EXACT)
    (tmp_path / "length.py").write_text(LENGTH)
    cfg = ScorerConfig(kinds=["reward_fn"], tasks={"arith": str(tmp_path / "exact.py"),
                                                   "essay": str(tmp_path / "length.py")}).validate()
    scorer = Scorer(cfg)
    try:
        batch = [rollout(0, "4", "4", "arith"), rollout(1, "hello", "x", "essay"), rollout(2, "5", "4", "arith"),
                 rollout(3, "4", "4", "poetry"), rollout(4, "4", "4", None)]
        out = scorer.score(batch)
    finally:
        scorer.close()
    assert [s.reward for s in out[:3]] == [1.0, 0.5, 0.0]
    assert [s.metadata.get("task") for s in out] == ["arith", "essay", "arith", "poetry", None]
    # a task no reward is named for (no default) fails its sample, saying why
    assert out[3].failed and "task 'poetry' (column 'task') has no reward: scorer.tasks names arith, essay" \
        in out[3].error
    assert out[4].failed and "task None" in out[4].error


def test_the_default_reward_scores_the_other_tasks_and_options_reach_each_task(tmp_path):
    (tmp_path / "exact.py").write_text(EXACT)
    (tmp_path / "scaled.py").write_text("S = 1.0\n\ndef configure(o):\n    global S\n    S = o['scale']\n\n"
                                        "def reward_fn(prompts, completions, labels):\n    return [S] * len(prompts)\n")
    cfg = ScorerConfig(kinds=["reward_fn"], task_key="source", reward_fn=str(tmp_path / "exact.py"),
                       tasks={"a": str(tmp_path / "scaled.py")}, task_options={"a": {"scale": 3.0}}).validate()
    scorer = Scorer(cfg)
    try:
        batch = [make_rollout("p", "4", "4"), make_rollout("p", "4", "4")]
        batch[0].columns = json.dumps({"source": "a"})
        out = scorer.score(batch)
    finally:
        scorer.close()
    assert [s.reward for s in out] == [3.0, 1.0] and out[0].metadata["task"] == "a" and "task" not in out[1].metadata


def test_task_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"scorer.tasks.b='nosuch' is neither a file nor a built-in"):
        ScorerConfig(tasks={"b": "nosuch"}).validate()
    with pytest.raises(ConfigError, match=r"task_options names \['c'\], which scorer.tasks does not"):
        ScorerConfig(tasks={"b": "math"}, task_options={"c": {}}).validate()
    assert task_of(make_rollout("p", "c", None).columns, "task") is None


def test_learner_and_evaluation_metrics_per_task():
    from buffer.eval import EvalGroup, Round, summarise
    from buffer.messages import ScoredRollout
    from buffer.prompts import Prompt
    from learner.batching import task_stats

    scored = [ScoredRollout(make_rollout("p", "abcd", "x"), reward=r, metadata={"task": t})
              for r, t in [(1.0, "a"), (0.0, "a"), (0.5, "b"), (0.0, "b"), (0.0, "b")]]
    stats = task_stats(scored)
    assert stats["task/a/reward_mean"] == 0.5 and stats["task/a/pass_rate"] == 0.5 and stats["task/a/share"] == 0.4
    assert stats["task/b/pass_rate"] == pytest.approx(1 / 3) and stats["task/b/completion_len"] == 5.0  # 4 + end
    # the evaluation: each task's prompts (groups of 2 samples) on their own
    groups = {}
    for g, (task, rewards) in enumerate([("a", [1.0, 0.0]), ("a", [0.0, 0.0]), ("b", [1.0, 1.0])]):
        groups[g] = EvalGroup(Prompt(f"p{g}", None, g), g, samples={
            i: ScoredRollout(make_rollout("p", "c", None), reward=r, metadata={"task": task})
            for i, r in enumerate(rewards)})
    values = summarise(Round(version=1, groups=groups, opened_at=0.0, k=2), threshold=1.0, seconds=1.0)
    assert (values["eval/a/pass@1"], values["eval/a/pass@k"], values["eval/a/prompts"]) == (0.25, 0.5, 2.0)
    assert (values["eval/b/pass@1"], values["eval/b/reward_mean"]) == (1.0, 1.0)
    assert values["eval/pass@1"] == 0.5  # over every task, as before


# ------------------------------------------------------------------------------------------------
# the generator's side: each row's task picks the environment it plays


def test_a_lease_is_split_by_each_groups_environment():
    from actors.tasks import TaskEnvs
    from buffer.messages import LeaseGrant, PromptGroup

    game, other = object(), object()
    envs = TaskEnvs({"game": game}, "task", default=other)
    groups = [PromptGroup(i, f"p{i}", None, columns=json.dumps({"task": t}) if t else "")
              for i, t in enumerate(["game", "arith", "game", None])]
    grant = LeaseGrant(lease_id=5, groups=groups, n_samples=2, ttl_s=60.0, version=0)
    seen = []
    out = envs.split(grant, lambda part, f: seen.append((f, [g.group_id for g in part.groups], part.lease_id)) or [f])
    assert seen == [(game, [0, 2], 5), (other, [1, 3], 5)] and out == [game, other]


def test_one_lease_plays_each_rows_environment_and_scores_each_task(tiny_model_dir):
    """A real engine (transformers, the tiny model): rows of task `game` play the guessing game
    (multi-turn), rows of task `arith` get one completion; the scorer scores the game by its
    episode's reward (`env`) and arithmetic by exact match."""
    from actors.config import GeneratorConfig
    from actors.engines.base import Sampling
    from actors.engines.hf import TransformersEngine
    from actors.envs.loader import load_env
    from actors.generator import Counters, make_rollouts
    from actors.tasks import TaskEnvs
    from buffer.messages import LeaseGrant, PromptGroup

    cfg = GeneratorConfig(model=str(tiny_model_dir), engine="transformers", max_new_tokens=3, max_turns=2,
                          use_chat_template=False, task_envs={"game": "guess"}).validate()
    engine = TransformersEngine(str(tiny_model_dir))
    groups = [PromptGroup(0, "Guess 1-31:", "17", columns=json.dumps({"task": "game"})),
              PromptGroup(1, "1+2=", "3", columns=json.dumps({"task": "arith"}))]
    client = type("Client", (), {"group_failed": lambda self, *a: pytest.fail(f"group failed: {a}")})()
    factory = TaskEnvs({"game": load_env("guess")}, "task")
    rollouts = make_rollouts(LeaseGrant(lease_id=1, groups=groups, n_samples=2, ttl_s=60.0, version=0), cfg, engine,
                             Sampling(temperature=1.0, max_tokens=3), client, "gen-test", Counters(), None, factory)
    by_group = {g: [r for r in rollouts if r.group_id == g] for g in (0, 1)}
    assert len(by_group[0]) == len(by_group[1]) == 2
    assert all(r.env_reward is not None and r.action_mask is not None for r in by_group[0])  # episodes
    assert all(r.env_reward is None and r.action_mask is None for r in by_group[1])  # one completion each
    tmp = Path(tempfile.mkdtemp())
    (tmp / "exact.py").write_text(EXACT)
    scorer = Scorer(ScorerConfig(kinds=["reward_fn"], tasks={"game": "env", "arith": str(tmp / "exact.py")}).validate())
    try:
        out = scorer.score(rollouts)
    finally:
        scorer.close()
    assert not any(s.failed for s in out), [s.error for s in out]
    assert [s.reward for s in out if s.metadata["task"] == "game"] == [r.env_reward for r in by_group[0]]
