"""Whole OpenRLHF command lines as its users write them, with the tiny model and local data put in,
run to completion through `launch.local` (real generator, scorer, buffer, learner, weight sync).

The RLVR recipe: REINFORCE with the group-mean baseline, a reward file in OpenRLHF's form that
imports `openrlhf.utils` (not installed here) and returns rewards, scores and extra logs, the KL as
a loss, asynchronous training, `--data.max_len` without `--rollout.max_new_tokens` (each completion
gets what its prompt leaves), 0.11.0's spelling of the vLLM correction, reward clipping, the stop-
properly penalty, EMA, token-budget micro-batches and sequence parallelism (two learner ranks
sharing every sequence, `--ds.ring_attn_size 2`): every flag is OpenRLHF 0.11.x's.
An untrained tiny policy earns 0 on every prompt, so dynamic filtering would drop every group: the
reward file's scores driving it are tests/actors/test_openrlhf_rewards.py's run. The asynchronous
agent recipe runs an agent file whose executor drives generation itself. The PPO quick start with a
reward model is tests/launch/test_openrlhf_cli.py's; the offline commands' are
tests/launch/test_openrlhf_offline.py's.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers.procs import ROOT, subprocess_env

REWARD_FILE = '''
import torch
from openrlhf.utils import grade_answer


def reward_func(queries, prompts, labels, **kwargs):
    answers = [q[len(p):].strip() for q, p in zip(queries, prompts)]
    rewards = torch.tensor([1.0 if grade_answer(a, l) else 0.0 for a, l in zip(answers, labels)])
    return {"rewards": rewards, "scores": rewards,
            "extra_logs": {"answer_len": torch.tensor([float(len(a)) for a in answers])}}
'''


def run_local(argv: list[str], save) -> list[dict]:
    """`python -m launch.local ARGV` to its end (exit 0), and the metrics rows it wrote under `save`."""
    res = subprocess.run([sys.executable, "-m", "launch.local", *argv], cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_an_rlvr_command_line_of_openrlhf_runs_to_completion(quick_start_files, tmp_path):
    reward = tmp_path / "reward_func.py"
    reward.write_text(REWARD_FILE)
    save = tmp_path / "checkpoint"
    argv = [
        "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1", "--actor.num_nodes", "1",
        "--actor.num_gpus_per_node", "2", "--ds.ring_attn_size", "2", "--vllm.num_engines", "1",
        "--vllm.tensor_parallel_size", "1",
        "--actor.model_name_or_path", quick_start_files["model"], "--reward.remote_url", str(reward),
        "--data.prompt_dataset", quick_start_files["prompts"], "--data.input_key", "input",
        "--data.label_key", "label", "--ckpt.output_dir", str(save), "--ckpt.save_steps", "-1",
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "16",
        "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "4", "--data.max_len", "32",
        "--train.num_episodes", "1", "--actor.adam.lr", "1e-5",
        "--algo.advantage.estimator", "reinforce_baseline", "--algo.kl.use_loss", "--algo.kl.estimator", "k2",
        "--algo.kl.init_coef", "0.001", "--train.async_enable", "--algo.advantage.is_correction_enable",
        "--algo.advantage.is_correction_type", "icepop", "--reward.clip_range", "-5", "5",
        "--reward.stop_properly_penalty_coef", "0.5", "--train.enable_ema", "--train.dynamic_batch_enable",
        "--train.max_tokens_per_gpu", "256", "--logger.tensorboard_dir", str(tmp_path / "tb"),
        "--learner.total_steps", "3",
    ]
    rows = run_local(argv, save)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert 0.0 <= r["reward/mean"] <= 1.0 and math.isfinite(r["loss/kl"])
        assert "reward/extra/answer_len" in r and r["perf/micro_batches"] >= 1
        assert r["perf/completion_len"] < 32  # no --rollout.max_new_tokens: what each prompt leaves of 32
    resolved = (save / "config.yaml").read_text()
    for key in ("advantage_estimator: reinforce_baseline", "behav_correction: icepop", "ema_beta: 0.992",
                "max_tokens_per_micro_batch: 256", "stop_properly_penalty_coef: 0.5", "prompt_max_len: 31",
                "max_len: 32", "sequence_parallel: 2", "learner_ranks: 2"):
        assert key in resolved, key
    assert (save / "checkpoints" / "step_3" / "config.json").is_file()  # the final one, the EMA's weights


AGENT_FILE = '''
import copy

import torch
from openrlhf.utils.agent import AgentExecutorBase


class AgentExecutor(AgentExecutorBase):
    """Two turns: an answer, the environment's "check:" and a second answer, scored on the last."""

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        tokens = hf_tokenizer(text=prompt, add_special_tokens=False)["input_ids"]
        log_probs, ranges = [0.0] * len(tokens), []
        for turn in range(2):
            params = copy.deepcopy(sampling_params)
            params.max_tokens = min(params.max_tokens, max_length - len(tokens))
            output = (await llm_engine.generate(tokens, params)).outputs[0]
            ranges.append((len(tokens), len(tokens) + len(output.token_ids)))
            tokens = tokens + list(output.token_ids)
            log_probs += [lp[t].logprob for t, lp in zip(output.token_ids, output.logprobs)]
            if turn == 0:
                feedback = hf_tokenizer(text=" check:", add_special_tokens=False)["input_ids"]
                tokens, log_probs = tokens + feedback, log_probs + [0.0] * len(feedback)
        reward = float(output.text.strip() == label)
        return {"prompt": prompt, "label": label, "observation_tokens": tokens, "action_ranges": ranges,
                "rollout_log_probs": log_probs, "reward": reward, "scores": reward,
                "extra_logs": {"turns": torch.tensor([2.0]), "last_len": len(output.token_ids)},
                "truncated": output.finish_reason == "length"}
'''


@pytest.mark.slow
def test_the_async_agent_recipe_of_openrlhf_runs_to_completion(quick_start_files, tmp_path):
    """OpenRLHF's asynchronous agent recipe: an agent file whose executor drives generation itself
    (`--train.agent_func_path`), group_norm advantages, async training."""
    agent = tmp_path / "agent_func.py"
    agent.write_text(AGENT_FILE)
    save = tmp_path / "checkpoint"
    argv = [
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1",
        "--actor.model_name_or_path", quick_start_files["model"], "--train.agent_func_path", str(agent),
        "--data.prompt_dataset", quick_start_files["prompts"], "--data.input_key", "input",
        "--data.label_key", "label", "--ckpt.output_dir", str(save), "--ckpt.save_steps", "-1",
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "4",
        "--train.micro_batch_size", "2", "--rollout.micro_batch_size", "2", "--data.max_len", "48",
        "--rollout.max_new_tokens", "4", "--actor.adam.lr", "1e-5", "--algo.advantage.estimator", "group_norm",
        "--train.async_enable", "--train.async_queue_size", "1", "--learner.total_steps", "2",
    ]
    rows = run_local(argv, save)
    steps = [r for r in rows if "loss/policy" in r]
    assert [r["step"] for r in steps] == [0, 1] and all(0.0 <= r["reward/mean"] <= 1.0 for r in steps)
    # the executor's extra_logs reach the metrics, as a reward file's do
    assert all(r["reward/extra/turns"] == 2.0 and 1.0 <= r["reward/extra/last_len"] <= 4.0 for r in steps)
    resolved = (save / "config.yaml").read_text()
    assert f"env: {agent}" in resolved and "max_context_tokens: 48" in resolved  # every turn within max_len
