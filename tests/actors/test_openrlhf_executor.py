"""OpenRLHF agent files that drive generation themselves (an `AgentExecutor` with its own `execute`):
actors/envs/agent_executor.py, in the generator's episode loop (actors/envs/episodes.py).

The pure parts first (the returned dict as a rollout, worked by hand; the batching of turns that
differ in max_tokens), then the file on a real vLLM engine on the tiny model, then one short whole
run through `launch.local`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from actors.config import GeneratorConfig
from actors.engines.base import Completion, Sampling
from actors.envs.agent_executor import ExecutorEpisodes, parts_of, to_sampling
from actors.envs.api import BadReturn, EnvLoadError
from actors.envs.episodes import rollout_of, run_episodes
from actors.envs.loader import load_env
from buffer.messages import PromptGroup
from tests.helpers.procs import ROOT, subprocess_env

# A two-turn exchange in OpenRLHF 0.11's style: generate, append the environment's feedback tokens,
# generate again; the reward is the share of the label's characters in the second answer. Labels
# starting with "!" make it return what OpenRLHF's contract does not allow.
AGENT_FILE = '''
import asyncio
import copy

from openrlhf.utils.agent import AgentExecutorBase

FEEDBACK = " again:"


class AgentExecutor(AgentExecutorBase):
    def __init__(self):
        self.returned = []

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        if label == "!hang":
            await asyncio.sleep(3600)
        tokens = hf_tokenizer(text=prompt, add_special_tokens=False)["input_ids"]
        log_probs = [0.0] * len(tokens)
        ranges, texts = [], []
        for turn in range(2):
            params = copy.deepcopy(sampling_params)
            params.max_tokens = min(params.max_tokens, max_length - len(tokens))
            output = (await llm_engine.generate(tokens, params)).outputs[0]
            ranges.append((len(tokens), len(tokens) + len(output.token_ids)))
            tokens = tokens + list(output.token_ids)
            log_probs += [lp[t].logprob for t, lp in zip(output.token_ids, output.logprobs)]
            texts.append(output.text)
            if turn == 0:
                feedback = hf_tokenizer(text=FEEDBACK, add_special_tokens=False)["input_ids"]
                tokens = tokens + feedback
                log_probs += [0.0] * len(feedback)
        reward = sum(c in texts[-1] for c in label) / len(label)
        result = {"prompt": prompt, "label": label, "observation_tokens": tokens, "action_ranges": ranges,
                  "rollout_log_probs": log_probs, "reward": reward, "scores": reward, "extra_logs": {},
                  "truncated": output.finish_reason == "length"}
        if label == "!ranges":
            result["action_ranges"] = ranges + [(len(tokens) - 1, len(tokens) + 3)]
        elif label == "!log_probs":
            result["rollout_log_probs"] = log_probs[:-1]
        elif label == "!reward":
            del result["reward"]
        elif label == "!raise":
            raise RuntimeError("the agent broke")
        self.returned.append(result)
        return result
'''


@pytest.fixture
def agent_file(tmp_path) -> Path:
    path = tmp_path / "agent_executor.py"
    path.write_text(AGENT_FILE)
    return path


# --------------------------------------------------------------------------------------------
# the pure parts


def test_the_returned_dict_becomes_the_rollouts_parts():
    # observation 10 11 | 12 13 (action) 14 (feedback) 15 (action): prompt 10 11, completion 12-15
    out = {"observation_tokens": [10, 11, 12, 13, 14, 15], "action_ranges": [(2, 4), (5, 6)],
           "rollout_log_probs": [0.0, 0.0, -0.5, -0.25, -7.0, -1.0], "reward": 0.75, "truncated": True,
           "scores": 0.5, "extra_logs": {"turns": 2}}
    calls = [([12, 13], [-0.5, -0.25], [3, 3]), ([15], [-1.0], [4])]
    p = parts_of(out, calls, version=9, vocab=100)
    assert (p.prompt_ids, p.ids, p.mask) == ([10, 11], [12, 13, 14, 15], [1, 1, 0, 1])
    assert p.logprobs == [-0.5, -0.25, 0.0, -1.0]  # the feedback's -7 is context: 0
    assert p.versions == [3, 3, 3, 4]  # the calls' own; the feedback takes the turn's before it
    assert (p.reward, p.truncated) == (0.75, True)
    assert p.info == {"filter_score": 0.5, "extra/turns": 2.0}  # the rollout's env_info
    # ranges that are not the engine's outputs: every token the oldest version the episode sampled with
    assert parts_of({**out, "observation_tokens": [10, 11, 12, 99, 14, 15]}, calls, 9, 100).versions == [3] * 4
    assert parts_of(out, [], version=9, vocab=100).versions == [9] * 4  # no call: the engine's version
    # rollout_log_probs None (logprobs not asked for): the engine's, where the ranges are its outputs
    assert parts_of({**out, "rollout_log_probs": None}, calls, 9, 100).logprobs == [-0.5, -0.25, 0.0, -1.0]


@pytest.mark.parametrize("change, says", [
    ({"action_ranges": [(2, 4), (5, 9)]}, r"'action_ranges' holding \(5, 9\): past the end \(of 6 observation_tok"),
    ({"action_ranges": [(3, 5), (2, 4)]}, r"'action_ranges' holding \(2, 4\): overlapping or out of order"),
    ({"action_ranges": [(0, 4)]}, r"'action_ranges' holding \(0, 4\): before a prompt token"),
    ({"action_ranges": [(2, 2)]}, "'action_ranges' .* that hold no token"),
    ({"action_ranges": "2-4"}, "'action_ranges' as str"),
    ({"rollout_log_probs": [0.0] * 5}, "'rollout_log_probs' as 5 values for 6 observation_tokens"),
    ({"rollout_log_probs": [0.0, 0.0, 0.5, -1, 0, -1]}, r"'rollout_log_probs'\[2\] float 0.5 for an action token"),
    ({"rollout_log_probs": None}, "'rollout_log_probs' None, and its 'action_ranges' are not the engine's"),
    ({"observation_tokens": [10, 11, 12, 13, 14, 500]}, "'observation_tokens' holding int 500, not a token id"),
    ({"reward": "high"}, "'reward' as str"),
    ({"truncated": "no"}, "'truncated' as str"),
    ({"extra_logs": {"acc": [1, 2]}}, r"'extra_logs'\['acc'\] as list"),
])
def test_a_malformed_return_names_its_key(change, says):
    out = {"observation_tokens": [10, 11, 12, 13, 14, 15], "action_ranges": [(2, 4), (5, 6)],
           "rollout_log_probs": [0.0, 0.0, -0.5, -0.25, 0.0, -1.0], "reward": 1.0, **change}
    with pytest.raises(BadReturn, match=says):
        parts_of(out, [], version=0, vocab=100)


def test_a_return_without_openrlhfs_keys_names_them():
    with pytest.raises(BadReturn, match=r"without 'action_ranges', 'rollout_log_probs', 'reward' \(it has "
                                        r"\['observation_tokens', 'prompt'\]\)"):
        parts_of({"observation_tokens": [1, 2], "prompt": "p"}, [], 0, 100)
    with pytest.raises(BadReturn, match="returned list"):
        parts_of([1, 2], [], 0, 100)


def test_a_requests_sampling_params_as_the_engines():
    from types import SimpleNamespace

    s = to_sampling(SimpleNamespace(temperature=0.5, top_p=0.9, top_k=-1, max_tokens=None, stop="</a>",
                                    stop_token_ids=[3], seed=7), room=20)
    assert s == Sampling(temperature=0.5, top_p=0.9, top_k=0, max_tokens=20, stop_token_ids=[3], stop=["</a>"], seed=7)
    assert to_sampling(SimpleNamespace(max_tokens=64), room=20).max_tokens == 20  # never past the context limit
    with pytest.raises(ValueError, match="n=2"):
        to_sampling(SimpleNamespace(n=2), room=20)


def test_turns_that_differ_in_max_tokens_share_one_engine_batch_each_cut_to_its_own(agent_file):
    """The file asks max_tokens = min(4, room). Context limit 20: "12+34=" (6 tokens) + 4 + " again:"
    (7) leaves its second turn 3, "1+2=" (4) leaves 5, so 4. Each round of turns is one engine batch
    sampled with the largest max_tokens; a turn that asked for fewer is cut to them, ended by length."""
    from demo.tiny_model import build_tokenizer

    tok = build_tokenizer()
    fours = tok.encode("4646", add_special_tokens=False)
    asked = []

    def generate(contexts, sampling):
        asked.append((len(contexts), sampling.max_tokens))
        ids = fours[:sampling.max_tokens]
        return [Completion(ids, [-0.5] * len(ids), "length", tok.decode(ids)) for _ in contexts]

    before = set(sys.modules)
    runner = load_env(str(agent_file))
    assert isinstance(runner, ExecutorEpisodes)
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] == "openrlhf"}  # no OpenRLHF, and none left
    cfg = GeneratorConfig(model="unused", max_context_tokens=20, max_new_tokens=4, use_chat_template=False,
                          session_timeout_s=2)
    engine = type("Engine", (), {"tokenizer": tok, "version": 2})()
    counts = Counter()
    played = run_episodes([PromptGroup(1, "12+34=", "46"), PromptGroup(2, "1+2=", "3"), PromptGroup(3, "1", "!hang")],
                          [[1]] * 3, 2, engine, Sampling(max_tokens=4), cfg, runner, generate, counts)
    assert asked == [(4, 4), (4, 4)] and counts["engine_batches"] == 2
    # an execute that never returns fails its own sample at generator.session_timeout_s, nothing else
    assert [e.failure.kind for e in played[3]] == ["timeout"] * 2 and counts["episodes_failed"] == 2
    assert "did not return within 2s (generator.session_timeout_s)" in played[3][0].failure.message
    feedback = tok.encode(" again:", add_special_tokens=False)
    for gid, prompt, second, reward in [(1, "12+34=", 3, 1.0), (2, "1+2=", 4, 0.0)]:
        for e in played[gid]:
            r = rollout_of(e, lease_id=1, worker_id="w")
            assert r.prompt_ids.tolist() == tok.encode(prompt, add_special_tokens=False)
            assert r.completion_ids.tolist() == fours + feedback + fours[:second]
            assert r.action_mask.tolist() == [1] * 4 + [0] * len(feedback) + [1] * second
            assert r.behav_logprobs.tolist() == [-0.5] * 4 + [0.0] * len(feedback) + [-0.5] * second
            assert r.versions.tolist() == [2] * len(r.completion_ids)
            assert (r.env_reward, r.finish_reason, e.turns) == (reward, "length", 2)  # "464" holds 4 and 6


# A MultiTurnAgentExecutor whose own execute calls OpenRLHF's loop and doubles the reward.
SUBCLASS_FILE = '''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn == 2
        return {"rewards": 0.5, "environment_feedback": "" if done else " no,", "done": done}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        out = await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images)
        return {**out, "reward": 2 * out["reward"]}
'''


def test_an_execute_that_calls_openrlhfs_multi_turn_loop_gets_it(tmp_path):
    from demo.tiny_model import build_tokenizer

    tok = build_tokenizer()
    fours = tok.encode("4646", add_special_tokens=False)
    contexts = []

    def generate(batch, sampling):
        contexts.extend(batch)
        return [Completion(fours, [-0.5] * 4, "stop", "4646") for _ in batch]

    path = tmp_path / "agent_func.py"
    path.write_text(SUBCLASS_FILE)
    runner = load_env(str(path))
    assert isinstance(runner, ExecutorEpisodes)
    cfg = GeneratorConfig(model="unused", max_context_tokens=40, max_new_tokens=4, use_chat_template=False)
    engine = type("Engine", (), {"tokenizer": tok, "version": 0})()
    played = run_episodes([PromptGroup(1, "1+2=", "3")], [[1]], 1, engine, Sampling(max_tokens=4), cfg, runner,
                          generate, Counter())
    r = rollout_of(played[1][0], lease_id=1, worker_id="w")
    prompt, no = tok.encode("1+2=", add_special_tokens=False), tok.encode(" no,", add_special_tokens=False)
    assert contexts == [prompt, prompt + fours + no]  # the second turn sampled after the feedback's tokens
    assert r.prompt_ids.tolist() == prompt and r.completion_ids.tolist() == fours + no + fours
    assert r.action_mask.tolist() == [1] * 4 + [0] * 4 + [1] * 4
    assert r.behav_logprobs.tolist() == [-0.5] * 4 + [0.0] * 4 + [-0.5] * 4
    assert (r.env_reward, r.finish_reason) == (2.0, "stop")  # the two steps' 0.5 each, doubled by the subclass


def test_an_executor_openrlhf_could_not_call_is_refused_at_load(tmp_path):
    old = tmp_path / "old_style.py"  # an older OpenRLHF's execute(prompt, label, sampling_params)
    old.write_text(AGENT_FILE.replace("sampling_params, max_length, hf_tokenizer, llm_engine, images=None",
                                      "sampling_params"))
    with pytest.raises(EnvLoadError, match=r"^generator.env='.*old_style.py': AgentExecutor.execute\(self, prompt, "
                                           r"label, sampling_params\) cannot take OpenRLHF 0.11's arguments"):
        load_env(str(old), key="generator.env")
    with pytest.raises(EnvLoadError, match=r"AgentExecutor\(\) cannot take the environment's arguments"):
        load_env(str(tmp_path / "old_style.py"), {"colour": "red"})
    broken = tmp_path / "broken.py"
    broken.write_text(AGENT_FILE.replace("self.returned = []", "raise OSError('no server')"))
    with pytest.raises(EnvLoadError, match=r"AgentExecutor\(\) raised OSError: no server"):
        load_env(str(broken))


# --------------------------------------------------------------------------------------------
# on a real vLLM engine


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    from actors.engines import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), dtype="float32", seed=0)
    yield engine
    engine.close()


@pytest.mark.slow
def test_the_files_execute_drives_the_engine_and_its_return_is_the_rollout(vllm_engine, tiny_model_dir, tmp_path):
    """Two samples of each prompt; what the file returned is, key by key, the rollout: its action
    mask, behaviour log-probs (the learner's log-probs of those tokens: the engine's, passed through)
    and env reward. Each malformed return (and a raise) fails its own sample, saying the file and key."""
    from learner.modeling import completion_logprobs, load_causal_lm

    path = tmp_path / "agent_executor.py"
    path.write_text(AGENT_FILE)
    runner = load_env(str(path), key="generator.env")
    groups = [PromptGroup(1, "12+34=", "46"), PromptGroup(2, "56+21=", "77"), PromptGroup(3, "1+1=", "!ranges"),
              PromptGroup(4, "1+1=", "!log_probs"), PromptGroup(5, "1+1=", "!reward"), PromptGroup(6, "1+1=", "!raise")]
    cfg = GeneratorConfig(model=str(tiny_model_dir), max_new_tokens=5, max_turns=2, use_chat_template=False)
    counts = Counter()

    def generate(contexts, sampling):  # as the generator's: one completion per context
        return [c[0] for c in vllm_engine.generate(contexts, 1, sampling)]

    played = run_episodes(groups, [[1]] * len(groups), 2, vllm_engine, Sampling(temperature=1.0, max_tokens=5), cfg,
                          runner, generate, counts)
    rollouts = [rollout_of(e, lease_id=1, worker_id="w") for g in (1, 2) for e in played[g]]
    assert all(e.failure is None for g in (1, 2) for e in played[g])
    returned = {tuple(d["observation_tokens"]): d for d in runner.executor.returned}
    for r in rollouts:
        d = returned[tuple(r.prompt_ids.tolist() + r.completion_ids.tolist())]
        (s1, e1), (s2, e2) = d["action_ranges"]
        assert len(r.prompt_ids) == s1 and e2 == s1 + len(r.completion_ids)  # the prompt: before the first action
        assert r.action_mask.tolist() == [1] * (e1 - s1) + [0] * (s2 - e1) + [1] * (e2 - s2)
        assert s2 - e1 == len(" again:") and e1 > s1  # the feedback's characters, between the two turns
        assert np.array_equal(r.behav_logprobs, np.float32(d["rollout_log_probs"][s1:]))
        assert r.env_reward == d["reward"] and r.finish_reason == ("length" if d["truncated"] else "stop")
        assert r.versions.tolist() == [0] * len(r.completion_ids) and r.label == d["label"]
    learner = completion_logprobs(load_causal_lm(str(tiny_model_dir)), [r.prompt_ids for r in rollouts],
                                  [r.completion_ids for r in rollouts], temperature=1.0)
    gap = max(float(np.abs(lp.numpy() - r.behav_logprobs)[r.action_mask == 1].max())
              for r, lp in zip(rollouts, learner))
    assert gap < 1e-4, f"behaviour log-probs vs the learner's: largest gap {gap:.3g}"
    # the malformed returns: each sample failed, saying the file and the key
    where = f"generator.env='{path}': AgentExecutor.execute"
    for gid, kind, says in [(3, "bad_return", "returned 'action_ranges' holding"),
                            (4, "bad_return", "returned 'rollout_log_probs' as"),
                            (5, "bad_return", "returned a dict without 'reward'"),
                            (6, "raised", "raised RuntimeError: the agent broke")]:
        for e in played[gid]:
            assert e.failure is not None and e.failure.kind == kind, e.failure
            assert e.failure.message.startswith(f"{where} {says}"), e.failure.message
    assert counts["bad_return"] == 6 and counts["raised"] == 2 and counts["episodes_failed"] == 8


# --------------------------------------------------------------------------------------------
# a whole run

RUN_CONFIG = """
run: {{mode: async, num_generators: 1, num_scorers: 1, learner_ranks: 1, threads_per_role: 1}}
buffer: {{prompts_per_step: 2, n_samples_per_prompt: 2, max_staleness: 1, lease_ttl_s: 60}}
generator:
  engine: vllm
  dtype: float32
  max_new_tokens: 4
  stop_token_ids: [88]
  groups_per_lease: 2
  use_chat_template: false
  env: {agent}
  max_turns: 2
scorer: {{kinds: [env]}}
learner:
  total_steps: 2
  advantage_estimator: grpo
  lr: 1.0e-4
  lr_schedule: constant
  warmup_steps: 0
  zero_stage: 0
  dtype: float32
  ppo_epochs: 1
  num_mini_batches: 1
  kl_coef: 0.0
  save_every: 0
weight_sync: {{backend: gloo, bucket_mb: 64}}
"""


@pytest.mark.slow
def test_a_short_run_with_the_executor_file_completes(tmp_path, tiny_model_dir, agent_file):
    """`launch.local` with the file as generator.env (as --train.agent_func_path maps to it) and the
    env scorer: two learner steps on the episodes the file played, every group accepted."""
    import subprocess

    from demo.arithmetic import make_problems, write_jsonl
    from launch.local import read_metrics

    config = tmp_path / "run.yaml"
    config.write_text(RUN_CONFIG.format(agent=agent_file))
    prompts = write_jsonl(make_problems(16, seed=0), tmp_path / "prompts.jsonl")
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "launch.local", str(config), "--run.run_dir", str(run_dir),
            "--learner.model_path", str(tiny_model_dir), "--buffer.prompts", str(prompts)]
    proc = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=180, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r]
    assert [r["step"] for r in steps] == [0, 1], steps
    # scored by the env scorer; the feedback's tokens are in the batches, masked out as context
    assert all("reward/env" in r and 0 < r["perf/env_token_frac"] < 1 for r in steps), steps
    roles = {r["name"]: r for r in json.loads((run_dir / "status.json").read_text())["roles"]}
    ready = roles["generator-0"]["ready"]
    assert ready["samples"] >= 8 and not {k for k in ready["episodes"] if k in ("raised", "bad_return", "timeout")}
