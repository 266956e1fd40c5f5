"""The environment API (actors/envs/api.py): the guessing game, OpenRLHF agent files, failures, the loader.

All in one process and fast: environments are plain Python, episodes run on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import textwrap
import threading
import time

import pytest

from actors.envs.api import (
    BadReturn,
    EnvFailure,
    Environment,
    EnvLoadError,
    Row,
    StepResult,
    check_step,
    encode_observation,
    run_episode,
    run_reset,
    run_step,
)
from actors.envs.loader import load_env
from demo.guess import HI, HIGHER, INVALID, LO, bisection_policy, make_problems, prompt_of, split_secrets


async def bisection(context: str) -> str:
    return bisection_policy(context)


async def always_one(context: str) -> str:
    return "1\n"


def play(env, row, policy, max_turns=10, timeout_s=1.0, counts=None):
    return asyncio.run(run_episode(env, row, policy, max_turns=max_turns, timeout_s=timeout_s, counts=counts))


# --------------------------------------------------------------------------------------------
# the guessing game


def test_bisection_wins_every_secret_and_a_policy_that_ignores_the_answers_loses_at_the_limit():
    make = load_env("guess")
    for secret in range(LO, HI + 1):
        ep = play(make(), Row(prompt_of(), str(secret)), bisection)
        # bisection over 31 values takes at most 5 guesses; a win in t guesses scores 1 - 0.05 (t - 1)
        assert ep.failure is None and ep.done and ep.info["won"] and ep.turns <= 5, (secret, ep)
        assert ep.reward == pytest.approx(1 - 0.05 * (ep.turns - 1))
    ep = play(make(), Row(prompt_of(), "16"), bisection)
    assert (ep.turns, ep.reward, ep.context) == (1, 1.0, "guess 1-31\n16\ncorrect\n")

    ep = play(make(), Row(prompt_of(), "20"), always_one)
    # the game ends itself after its 5 turns (before the runner's 10), every answer "higher", reward 0
    assert ep.done and not ep.info["won"] and (ep.turns, ep.reward) == (5, 0.0)
    assert ep.context == "guess 1-31\n" + "1\nhigher\n" * 5

    short = load_env("examples/envs/guess.py:GuessEnv", {"max_turns": 2, "turn_penalty": 0.0})
    ep = play(short(), Row(prompt_of(), "20"), bisection)
    assert ep.done and not ep.info["won"] and ep.turns == 2  # 16, 24: not found within 2
    env = short()
    asyncio.run(run_reset(env, Row(prompt_of(), "7"), 1.0))
    assert asyncio.run(run_step(env, "seven\n", 1.0)) == StepResult(INVALID, 0.0, False, {"won": False, "turns": 1})
    assert asyncio.run(run_step(env, "3\n", 1.0)).observation == HIGHER


def test_problems_and_held_out_secrets():
    train, held = split_secrets(8, seed=0)
    assert len(held) == 8 and sorted(train + held) == list(range(LO, HI + 1))
    rows = make_problems(200, seed=1, secrets=train)
    assert {r["prompt"] for r in rows} == {"guess 1-31\n"}  # the prompt tells nothing of the secret
    assert {int(r["label"]) for r in rows} <= set(train) and len({r["label"] for r in rows}) > 15
    assert rows == make_problems(200, seed=1, secrets=train)  # seeded
    with pytest.raises(ValueError, match="within 1-31"):
        make_problems(3, seed=0, secrets=[40])


# --------------------------------------------------------------------------------------------
# OpenRLHF agent files, written as OpenRLHF's README and examples/python/agent_func.py write them

AGENT_FUNC = '''
import random
from typing import Any, Dict

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


# The guessing game: the secret is the label
class AgentInstance(AgentInstanceBase):
    {init}(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = 5
        self.seen = []

    async def reset(self, states: dict, **kwargs):
        return {{"observation": states["observation"]}}  # Return original text observation

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        self.seen.append(dict(states))
        observation_text = states["observation_text"]
        action_text = states["action_text"]
        label = states["label"]

        guess = int(action_text.strip())
        self.step_idx += 1
        correct = guess == int(label)
        done = correct or self.step_idx >= self.max_steps
        reward = torch.tensor(1.0) if correct else torch.tensor(-0.1)
        if correct:
            environment_feedback = "\\n\\nHuman: [CORRECT]\\n</s>"
        else:
            hint = "higher" if guess < int(label) else "lower"
            environment_feedback = f"\\n\\nHuman: {{hint}}\\n</s>\\n\\nAssistant: "

        return {{
            "rewards": reward,  # Rewards for advantage calculation
            "scores": torch.tensor(float(correct)),  # Scores for dynamic filtering (0-1 reward)
            "environment_feedback": environment_feedback,  # Environment feedback text
            "done": done,  # Boolean indicating if the episode is complete
            "sampling_params": states.get("sampling_params", None),  # Parameters for vLLM sampling in next step
            "extra_logs": {{"guesses": torch.tensor([self.step_idx])}},  # Additional logging information
        }}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


@pytest.mark.parametrize("init", ["def __init__", "async def __init__"])  # the example's, the README's
def test_an_openrlhf_agent_file_runs_unchanged(tmp_path, init):
    path = tmp_path / "agent_func.py"
    path.write_text(AGENT_FUNC.format(init=init))
    before = set(sys.modules)
    make = load_env(str(path))  # a bare file path, as --train.agent_func_path gives it
    assert not any(m == "openrlhf" or m.startswith("openrlhf.") for m in set(sys.modules) - before)
    assert "openrlhf" not in sys.modules

    env = make()
    assert env.observation_role is None  # the feedback carries its own markup: appended as text
    prompt = "Human: guess a number from 1 to 31\n\nAssistant: "
    actions = iter(["16", "8", "12"])

    async def policy(context: str) -> str:
        return next(actions)

    ep = play(env, Row(prompt, "12"), policy)
    assert ep.failure is None and ep.done and ep.turns == 3
    assert ep.reward == pytest.approx(-0.1 - 0.1 + 1.0)  # rewards summed over the steps, as OpenRLHF does
    assert ep.info["scores"] == 1.0 and ep.info["extra_logs"] == {"guesses": 3}
    assert "sampling_params" not in ep.info  # the file passed back the None it was given
    feedback = ["\n\nHuman: lower\n</s>\n\nAssistant: ", "\n\nHuman: higher\n</s>\n\nAssistant: ",
                "\n\nHuman: [CORRECT]\n</s>"]
    assert ep.context == prompt + "16" + feedback[0] + "8" + feedback[1] + "12" + feedback[2]
    # what each step saw: the text before its action, the action, the label, the sampling params
    assert env.agent.seen == [
        {"observation_text": prompt, "action_text": "16", "label": "12", "sampling_params": None},
        {"observation_text": prompt + "16" + feedback[0], "action_text": "8", "label": "12", "sampling_params": None},
        {"observation_text": prompt + "16" + feedback[0] + "8" + feedback[1], "action_text": "12", "label": "12",
         "sampling_params": None}]
    assert make().agent is None and make() is not env  # a fresh instance per episode


def test_openrlhf_agent_mistakes_are_counted_failures(tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text(textwrap.dedent('''
        from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

        class AgentInstance(AgentInstanceBase):
            def __init__(self, answer=None):
                self.answer = answer

            async def step(self, states):
                return self.answer

        class AgentExecutor(MultiTurnAgentExecutor):
            def __init__(self):
                super().__init__(AgentInstance)
        '''))
    counts = collections.Counter()
    for answer in ({"rewards": 1.0, "done": True}, "text", {"rewards": "1", "environment_feedback": "", "done": True}):
        env = load_env(str(path), {"answer": answer})()
        assert asyncio.run(run_reset(env, Row("p"), 1.0)) is None  # AgentInstanceBase.reset: the states themselves
        assert asyncio.run(run_step(env, "a", 1.0, counts)).kind == "bad_return"
    assert counts == {"bad_return": 3}
    env = load_env(str(path), {"answer": {"rewards": 0.5, "environment_feedback": "", "done": False}})()
    asyncio.run(run_reset(env, Row("p"), 1.0))
    assert asyncio.run(run_step(env, "a", 1.0)) == StepResult("", 0.5, False, {"scores": 0.5, "extra_logs": {},
                                                                               "env_info": {"filter_score": 0.5}})
    # the scores and extra logs the rollout carries: numbers, named; anything else fails the sample
    for extra, ok in (({"acc": 1.0, "len": 3}, True), ({"acc": "high"}, False), ({"": 1.0}, False),
                      ({f"k{i}": 1.0 for i in range(64)}, False)):
        env = load_env(str(path), {"answer": {"rewards": 0.5, "environment_feedback": "", "done": True,
                                              "scores": 2.0, "extra_logs": extra}})()
        asyncio.run(run_reset(env, Row("p"), 1.0))
        res = asyncio.run(run_step(env, "a", 1.0, counts))
        if ok:
            assert res.info["env_info"] == {"filter_score": 2.0, "extra/acc": 1.0, "extra/len": 3.0}
        else:
            assert res.kind == "bad_return" and "extra_logs" in res.message, res


# --------------------------------------------------------------------------------------------
# environments that fail


class Raises(Environment):
    async def step(self, action):
        raise KeyError("no such room")


class Hangs(Environment):
    async def step(self, action):
        await asyncio.sleep(3600)


class Blocks(Environment):
    """A plain `def` that blocks: it runs in a thread, so the loop and its timeout carry on."""

    release = threading.Event()

    def step(self, action):
        self.release.wait(60)
        return StepResult("late", 0.0, True, {})


class Garbage(Environment):
    async def step(self, action):
        return "the answer is 42"


class NanReward(Environment):
    async def step(self, action):
        return ("ok", float("nan"), True, {})


class Exits(Environment):
    async def step(self, action):
        raise SystemExit(3)


class BadOpening(Environment):
    async def reset(self, row):
        return {"text": row.prompt}


def test_a_raising_hanging_or_garbage_environment_fails_its_episode_and_nothing_else():
    guess = load_env("guess")
    envs = [Raises(), Hangs(), Blocks(), Garbage(), NanReward(), Exits(), BadOpening()] + [guess() for _ in range(6)]
    rows = [Row(prompt_of(), "5")] * 7 + [Row(prompt_of(), str(s)) for s in (1, 9, 16, 22, 30, 31)]
    counts = collections.Counter()

    async def all_at_once():
        return await asyncio.gather(*(run_episode(e, r, bisection, max_turns=10, timeout_s=0.5, counts=counts)
                                      for e, r in zip(envs, rows)))

    start = time.monotonic()
    episodes = asyncio.run(all_at_once())
    elapsed = time.monotonic() - start
    Blocks.release.set()
    kinds = [ep.failure and ep.failure.kind for ep in episodes]
    assert kinds == ["raised", "timeout", "timeout", "bad_return", "bad_return", "raised", "bad_return"] + [None] * 6
    assert counts == {"raised": 2, "timeout": 2, "bad_return": 3}
    assert "KeyError" in episodes[0].failure.message and "SystemExit(3)" in episodes[5].failure.message
    assert "0.5s" in episodes[1].failure.message and "'the answer is 42'" in episodes[3].failure.message
    assert "opening as dict" in episodes[6].failure.message and episodes[6].turns == 0
    assert all(ep.info["won"] for ep in episodes[7:])  # the good episodes ran on, concurrently
    assert elapsed < 2.0, elapsed  # one timeout's worth, not one per failing environment

    bad_label = asyncio.run(run_reset(guess(), Row(prompt_of(), None), 1.0, counts))
    assert isinstance(bad_label, EnvFailure) and bad_label.kind == "raised" and "label None" in bad_label.message


def test_check_step():
    assert check_step(("o", 1, False, None)) == StepResult("o", 1.0, False, {})
    assert check_step(StepResult("o", 0.5, 1)).done is True
    for raw, says in [("o", "expected StepResult"), (("o", 1.0, True), "expected StepResult"),
                      ((3, 1.0, True, {}), "observation as int"), (("o", True, True, {}), "reward as bool"),
                      (("o", [1.0], True, {}), "reward as list"), (("o", 1.0, "yes", {}), "done as str"),
                      (("o", 1.0, 0.5, {}), "done as float"), (("o", 1.0, True, []), "info list"),
                      (("o" * (1 << 21), 0.0, True, {}), "characters")]:
        with pytest.raises(BadReturn, match=says):
            check_step(raw)


# --------------------------------------------------------------------------------------------
# observations as ids


# Qwen's (ChatML) layout; the tokenizer a byte-level BPE trained on such conversations, so that its
# merges are those of a real chat model's tokenizer, not one id per character
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from demo.guess import bisection_turns

    corpus = ["<|im_start|>user\nguess 1-31<|im_end|>\n" + "".join(
        f"<|im_start|>assistant\n{g.strip()}<|im_end|>\n<|im_start|>user\n{a.strip()}<|im_end|>\n"
        for g, a in bisection_turns(secret)) for secret in range(LO, HI + 1)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")


def test_an_observation_appended_as_ids_equals_the_whole_conversation_rendered():
    tok = chatml_tokenizer()

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    assert encode_observation(tok, "lower\n") == encode("lower\n")  # no chat template: the text itself
    tok.chat_template = CHATML
    assert encode_observation(tok, "lower\n", None) == encode("lower\n")  # role None: the text itself
    chat = [{"role": "user", "content": "guess 1-31"}]
    ids = encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    for guess, answer in [("16", "lower"), ("8", "higher")]:
        ids += encode(guess) + [tok.eos_token_id]  # the policy's turn, ending in its end-of-turn token
        ids += encode_observation(tok, answer, "user")
        chat += [{"role": "assistant", "content": guess}, {"role": "user", "content": answer}]
    assert ids == encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert len(encode("guess")) == 1  # (merged: the check above is not one id per character)
    tool = "\n<|im_start|>tool\nhigher<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(encode_observation(tok, "higher", "tool")) == tool

    tok.chat_template = "{{ messages | length }}" + CHATML  # earlier turns render differently later
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        encode_observation(tok, "lower")
    tok.chat_template = CHATML.replace("<|im_end|>", "#")
    with pytest.raises(ValueError, match="pass end_of_turn"):
        encode_observation(tok, "lower")
    opened = tok.decode(encode_observation(tok, "lower", end_of_turn="#"))
    assert opened == "\n<|im_start|>user\nlower#\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------------------------
# the loader


def test_loader_errors_say_what_is_wrong(tmp_path):
    (tmp_path / "envs.py").write_text(textwrap.dedent('''
        NOT_A_CLASS = 3

        class NoStep:
            async def reset(self, row):
                return None

        class TwoArgs:
            async def reset(self, row):
                return None

            async def step(self, action, extra):
                return ("", 0.0, True, {})

        class Sized:
            def __init__(self, size: int):
                self.size = size

            async def step(self, action):
                return ("", 0.0, True, {})

            async def reset(self, row):
                return None
        '''))
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    (tmp_path / "plain.py").write_text("X = 1\n")
    (tmp_path / "bad_executor.py").write_text(textwrap.dedent('''
        from openrlhf.utils.agent import MultiTurnAgentExecutor

        class AgentExecutor(MultiTurnAgentExecutor):
            def __init__(self):
                super().__init__(dict)
        '''))
    # an older OpenRLHF's layout: an AgentExecutorBase that takes the engine; its AgentInstance is played
    (tmp_path / "old_agent.py").write_text(textwrap.dedent('''
        from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase

        class AgentInstance(AgentInstanceBase):
            async def __init__(self, *args, **kwargs):
                pass

            async def step(self, states, **kwargs):
                return {"rewards": 1.0, "environment_feedback": "", "done": True}

        class AgentExecutor(AgentExecutorBase):
            def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
                super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)
        '''))
    envs = tmp_path / "envs.py"
    for spec, kwargs, says in [
        (f"{tmp_path}/missing.py:Env", None, "no such file"),
        (f"{envs}:Missing", None, "defines no 'Missing' .*NoStep, Sized, TwoArgs"),
        (f"{envs}:NOT_A_CLASS", None, "NOT_A_CLASS is int 3, not a class"),
        (f"{envs}:NoStep", None, "NoStep has no step"),
        (f"{envs}:TwoArgs", None, r"TwoArgs.step\(self, action, extra\) must take one argument"),
        (f"{envs}:Sized", None, r"Sized\(size: int\) cannot take the environment's arguments \{\}"),
        (f"{envs}:Sized", {"size": 1, "colour": "red"}, "unexpected keyword argument 'colour'"),
        (f"{tmp_path}/broken.py:Env", None, "importing .*broken.py raised ModuleNotFoundError"),
        (str(tmp_path / "plain.py"), None, "must define `AgentExecutor"),
        (str(tmp_path / "bad_executor.py"), None, r"AgentExecutor\(\) raised TypeError: .* AgentInstanceBase"),
        ("no_such_package.mod:Env", None, "importing module 'no_such_package.mod' failed"),
        ("gues", None, "neither a file, nor module:Class, nor a name of \\['guess'\\]"),
    ]:
        with pytest.raises(EnvLoadError, match=says):
            load_env(spec, kwargs)
    with pytest.raises(EnvLoadError, match="^generator.env='nope.py': no such file"):
        load_env("nope.py", key="generator.env")
    assert load_env(f"{envs}:Sized", {"size": 4})().size == 4
    assert type(load_env("actors.envs.api:Environment")()) is Environment  # an importable module
    old = load_env(str(tmp_path / "old_agent.py"))()
    assert asyncio.run(run_episode(old, Row("p"), always_one, max_turns=3, timeout_s=1.0)).reward == 1.0


def test_a_row_from_a_leased_prompt_group():
    from buffer.messages import ChatMessage, PromptGroup

    group = PromptGroup(group_id=7, prompt="guess 1-31\n", label="5", index=3,
                        messages=[ChatMessage("system", "play"), ChatMessage("user", "guess 1-31\n")])
    assert Row.of(group) == Row("guess 1-31\n", "5", [{"role": "system", "content": "play"},
                                                      {"role": "user", "content": "guess 1-31\n"}], 3)
    assert Row.of(PromptGroup(group_id=8, prompt="p")) == Row("p")
