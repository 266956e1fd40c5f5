"""The tools environment (actors/envs/tool_env.py): a turn calls tools or answers; tools that fail are observations.

Episodes run through actors.envs.api's run_reset/run_step (run_episode) with scripted policies; the
tools are the real calculator and the real Python sandbox (a subprocess per call).
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from actors.envs.api import EnvFailure, EnvLoadError, Row, StepResult, run_episode, run_reset, run_step
from actors.envs.loader import load_env
from actors.envs.tool_env import ToolEnv, exact_match
from actors.tools.calculator import Calculator
from actors.tools.registry import Tool, ToolRegistry

TASK = Row(prompt="365*48+801=", label="18321")
TAGS = {"tools": ["calculator"], "format": "tags"}


def scripted(*turns: str):
    """A policy that writes `turns` in order; "{result}" stands for the last <result> in the context."""
    it = iter(turns)

    async def policy(context: str) -> str:
        results = re.findall(r"<result>(.*?)</result>", context, re.DOTALL)
        return next(it).replace("{result}", results[-1] if results else "")
    return policy


def play(env, policy, row=TASK, max_turns=4):
    return asyncio.run(run_episode(env, row, policy, max_turns=max_turns, timeout_s=10.0))


def test_a_calculator_call_then_the_right_answer_scores_1_and_a_wrong_one_0():
    make = load_env("tools", TAGS, "generator.env")
    ep = play(make(), scripted("<calc>365*48+801</calc>", "{result}"))
    # turn 1 calls, its result is the observation; turn 2 (no call) is the answer, scored against the label
    assert ep.failure is None and ep.done and (ep.turns, ep.reward) == (2, 1.0)
    assert ep.context == "365*48+801=<calc>365*48+801</calc><result>18321</result>18321"
    assert ep.info == {"tool_calls": 1, "tool_errors": 0}

    ep = play(make(), scripted("<calc>365*48</calc>", "{result}"))  # the wrong expression
    assert ep.done and (ep.turns, ep.reward) == (2, 0.0) and ep.context.endswith("<result>17520</result>17520")
    ep = play(make(), scripted("18000"))  # an answer without a call: scored at once
    assert ep.done and (ep.turns, ep.reward) == (1, 0.0)
    ep = play(make(), scripted(*["<calc>1+1</calc>"] * 3), max_turns=3)  # never answers: cut at the turn limit
    assert not ep.done and (ep.turns, ep.reward) == (3, 0.0)

    env = make()
    assert (env.observation_role, env.stop, env.tools[0]["function"]["name"]) == ("tool", ["</calc>"], "calculator")


def test_tools_that_crash_hang_or_flood_give_error_observations_and_the_episode_goes_on():
    make = load_env("tools", {"tools": {"calculator": {}, "python": {"timeout_s": 1.0}}, "format": "tags"})
    env = make()
    assert asyncio.run(run_reset(env, TASK, 5.0)) is None  # the prompt states the task

    def step(action: str) -> StepResult:
        result = asyncio.run(run_step(env, action, 10.0))
        assert isinstance(result, StepResult) and not result.done and result.reward == 0.0, result
        return result

    hang = step("<python>import time\ntime.sleep(60)</python>")
    assert hang.observation == "<result>error: python timed out after 1.0 s</result>" and hang.info["tool_errors"] == 1
    crash = step("<python>raise ValueError('no luck')</python>")
    assert crash.observation.startswith("<result>error: python exited with status 1\n")
    assert crash.observation.endswith("ValueError: no luck</result>")
    flood = step("<python>print('x' * 10_000_000)</python>")  # 10 MB: the first 64 KiB and a count of the rest
    assert len(flood.observation) < 70_000 and flood.observation.endswith(" more bytes dropped]</result>")
    bad = step("<calc>1/0</calc><calc>2**</calc>")
    assert bad.observation == ("<result>error: calculator: division by zero</result>"
                               "<result>error: calculator: not an arithmetic expression: '2**'</result>")
    right = step("<python>print(365*48+801)</python>")
    assert right.observation == "<result>18321\n</result>" and right.info == {"tool_calls": 1, "tool_errors": 0}
    answer = asyncio.run(run_step(env, "18321", 10.0))
    # errors: the hang, the crash, the two calculator calls (a flood cut short is output, not an error)
    assert answer == StepResult("", 1.0, True, {"tool_calls": 6, "tool_errors": 4})


class Raises(Tool):
    name, tag = "broken", "broken"
    parameters = {"type": "object", "properties": {"x": {"type": "string"}}}

    async def call(self, arguments):
        raise KeyError(arguments["x"])


class Sleeps(Tool):
    name, tag = "slow", "slow"
    parameters = {"type": "object", "properties": {"x": {"type": "string"}}}

    async def call(self, arguments):
        await asyncio.sleep(60)
        return "never"


def test_a_tool_of_ours_that_raises_or_hangs_is_an_observation_too():
    registry = ToolRegistry([Calculator(), Raises(), Sleeps()], timeout_s=0.2)
    ep = play(ToolEnv(registry, "tags"), scripted("<broken>k</broken>", "<slow>z</slow>", "<calc>365*48+801</calc>",
                                                  "{result}"))
    assert ep.failure is None and ep.done and (ep.turns, ep.reward) == (4, 1.0)
    assert "<result>error: broken raised KeyError: 'k'</result>" in ep.context
    assert "<result>error: slow timed out after 0.2 s</result>" in ep.context
    env = ToolEnv(registry, "tags", max_calls=2)  # a turn of many calls runs the first max_calls
    result = asyncio.run(run_step(env, "<calc>1</calc><calc>2</calc><calc>3</calc>", 1.0))
    assert result.observation == ("<result>1</result><result>2</result>"
                                  "<result>error: more than 2 tool calls in one turn; not run</result>")


def test_hermes_calls_come_back_as_the_results_a_tool_message_holds():
    env = load_env("tools", {"tools": ["calculator"]})()  # hermes is the default format
    asyncio.run(run_reset(env, TASK, 1.0))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
    one = asyncio.run(run_step(env, call % "365*48", 1.0))
    assert one.observation == "17520" and env.stop == []
    # two calls: a template that wraps a tool message in <tool_response> tags shows two responses
    two = asyncio.run(run_step(env, call % "1+1" + "\n" + call % "2*3", 1.0))
    wrapped = f"<tool_response>\n{two.observation}\n</tool_response>"
    assert wrapped == "<tool_response>\n2\n</tool_response>\n<tool_response>\n6\n</tool_response>"
    unknown = asyncio.run(run_step(env, '<tool_call>{"name": "search", "arguments": {}}</tool_call>', 1.0))
    assert unknown.observation == "error: unknown tool 'search'; tools are ['calculator']"
    assert json.loads(json.dumps(env.tools))[0]["function"]["parameters"]["required"] == ["expression"]


def test_a_reward_function_file_scores_the_answer_and_one_that_raises_fails_the_episode(tmp_path):
    make = load_env("tools", {**TAGS, "reward": "examples/rewards/arithmetic.py"})  # answer: the first line
    assert play(make(), scripted("<calc>365*48+801</calc>", "{result}\nthat is all")).reward == 1.0
    path = tmp_path / "strict.py"
    path.write_text("def half(prompts, completions, labels):\n    return [0.5 if completions[0] else 1 / 0]\n")
    make = load_env("tools", {**TAGS, "reward": f"{path}:half"})
    assert play(make(), scripted("17")).reward == 0.5
    ep = play(make(), scripted(""))
    assert ep.failure == EnvFailure("raised", "ToolEnv.step raised ZeroDivisionError: division by zero")
    assert exact_match(" 7\n", Row(prompt="", label="7")) == 1.0 and exact_match("7", Row(prompt="")) == 0.0


@pytest.mark.parametrize("kwargs, why", [
    ({}, r"needs tools, e\.g\. env_args: \{tools: \[calculator, python\]\}"),
    ({"tools": ["calc"]}, r"unknown tool 'calc'; tools are calculator, python, or a Tool subclass"),
    ({"tools": "calculator"}, r"tools='calculator'; expected a list of names or a mapping name -> kwargs"),
    ({"tools": ["calculator"], "formt": "tags"}, r"unknown argument\(s\) \['formt'\]"),
    ({"tools": ["calculator"], "format": "xml"}, r"tool format must be 'hermes' or 'tags', got 'xml'"),
    ({"tools": {"python": {"timeout": 1}}}, r"tool 'python' cannot take \{'timeout': 1\}"),
    ({"tools": ["actors.tools.registry:ToolCall"]},
     r"tool 'actors.tools.registry:ToolCall' is not a subclass of actors.tools.registry.Tool"),
    ({"tools": ["calculator"], "max_calls": 0}, r"max_calls=0; expected a whole number >= 1"),
    ({"tools": ["calculator"], "reward": "nope.py"}, r"no such file 'nope.py'"),
    ({"tools": ["calculator"], "reward": "actors.tools.registry:nothing"},
     r"actors.tools.registry defines no 'nothing'"),
])
def test_bad_tool_env_arguments_are_refused_at_load(kwargs, why):
    with pytest.raises(EnvLoadError, match=r"generator\.env='tools': " + why):
        load_env("tools", kwargs, "generator.env")


def test_in_the_generators_loop_a_tool_turn_is_the_policys_ids_then_the_results_ids():
    """ToolEnv in actors.envs.episodes' loop, the tiny character tokenizer, a scripted stand-in for the engine."""
    from collections import Counter
    from types import SimpleNamespace

    from actors.config import GeneratorConfig
    from actors.engines.base import Completion, Sampling
    from actors.envs.episodes import rollout_of, run_episodes
    from buffer.messages import PromptGroup
    from demo.tiny_model import build_tokenizer

    tok = build_tokenizer()

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    turns = iter(["<calc>365*48+801</calc>", "18321"])
    contexts = []

    def generate(batch, sampling):
        contexts.extend(batch)
        assert sampling.stop == ["</calc>"]  # the format's stop strings end a turn right after its call
        text = next(turns)
        return [Completion(enc(text), [-0.5] * len(text), "stop", text)]

    prompt = tok.encode(TASK.prompt)
    cfg = GeneratorConfig(model="unused", max_turns=3, max_new_tokens=32, use_chat_template=False)
    engine = SimpleNamespace(tokenizer=tok, version=5)
    played = run_episodes([PromptGroup(1, TASK.prompt, TASK.label)], [prompt], 1, engine, Sampling(max_tokens=32), cfg,
                          load_env("tools", TAGS), generate, Counter())
    (ep,) = played[1]
    call, result, answer = enc("<calc>365*48+801</calc>"), enc("<result>18321</result>"), enc("18321")
    assert ep.failure is None and ep.finish == "stop" and (ep.turns, ep.reward) == (2, 1.0)
    assert ep.ids == call + result + answer and contexts == [prompt, prompt + call + result]
    assert ep.mask == [1] * len(call) + [0] * len(result) + [1] * len(answer)  # the results are context, not actions
    rollout = rollout_of(ep, lease_id=1, worker_id="w")
    assert rollout.env_reward == 1.0
    assert rollout.behav_logprobs[len(call):len(call) + len(result)].tolist() == [0.0] * len(result)


def test_the_example_config_and_its_tasks(tmp_path):
    from launch.run_config import load_run_config

    run = load_run_config("examples/envs/calculator.yaml", ["--learner.model_path", str(tmp_path)])
    g = run.generator
    rows = [json.loads(line) for line in open(run.buffer.prompts)]
    make = load_env(g.env, g.env_args, "generator.env")
    for row in rows[:3]:  # each task is its expression and "=", its label the value
        ep = play(make(), scripted(f"<calc>{row['prompt'].rstrip('=')}</calc>", "{result}"),
                  Row(prompt=row["prompt"], label=row["label"]), max_turns=g.max_turns)
        assert ep.done and ep.reward == 1.0, (row, ep)


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_hermes_prompts_carry_the_tools_schemas_and_a_cut_turn_is_closed():
    """With hermes, the generator renders each prompt with the tools' schemas as `tools=` (the
    tags format does not: such templates describe JSON calls); a turn a stop string or the token
    limit ended gets the template's end-of-turn id before the observation."""
    from actors.envs.episodes import close_turn
    from actors.prompts import encode_prompt
    from demo.tiny_model import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = HERMES_TEMPLATE.replace("<|im_start|>", "#").replace("<|im_end|>", "</s>")
    hermes = load_env("tools", {"tools": ["calculator", "python"]})
    assert load_env("tools", TAGS).chat_tools is None
    names = [t["function"]["name"] for t in hermes.chat_tools]
    assert names == ["calculator", "python"] and hermes().tools == hermes.chat_tools
    text = tok.decode(encode_prompt(tok, "2+3=", True, tools=hermes.chat_tools))
    assert text.startswith("#system\nTools: calculator python</s>") and text.endswith("#user\n2+3=</s>\n#assistant\n")
    assert tok.decode(encode_prompt(tok, "2+3=", True)).startswith("#user")
    eos = tok.eos_token_id
    assert close_turn(tok, [5, 6], "tool", True) == [eos]  # cut short: the template's end of turn is added
    assert close_turn(tok, [5, eos], "tool", True) == []  # the policy ended it itself
    assert close_turn(tok, [5, 6], "tool", False) == [] and close_turn(tok, [5, 6], None, True) == []
