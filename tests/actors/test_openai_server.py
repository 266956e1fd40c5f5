"""The OpenAI-compatible endpoint for agent code (actors/agents/openai_server.py, actors/agents/sessions.py)
over real HTTP with the real `openai` client, the engine a scripted stand-in (every turn samples
"ab"), so what is checked is the sessions' bookkeeping; tests/actors/test_engines.py has the same
endpoint on the vLLM engine (exact ids, log-probs against the learner)."""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import httpx
import openai
import pytest

from actors.agents.openai_server import AgentServer
from actors.agents.sessions import encode_turn, load_agent
from actors.config import GeneratorConfig
from actors.engines.base import Completion, Sampling
from actors.envs.api import EnvLoadError
from buffer.messages import PromptGroup
from demo.tiny_model import build_tokenizer
from tests.helpers.buffer import start_buffer, started
from tests.helpers.procs import start_role, stop, wait_exit

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


async def _agent(base_url: str, row, **_):
    """What each row's label asks of its session."""
    how = row.label
    if how == "key":  # the session id as the api_key, the plain /v1 path; the reward POSTed
        sid = base_url.split("/s/")[1].split("/")[0]
        client = openai.AsyncOpenAI(base_url=base_url.split("/s/")[0] + "/v1", api_key=sid, max_retries=0)
    else:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
    async with client:
        if how == "raise":
            raise RuntimeError("the agent broke")
        out = await client.completions.create(model="m", prompt=row.prompt, max_tokens=2, logprobs=0)
        text = out.choices[0].text
        assert out.choices[0].logprobs.token_logprobs == [-0.25, -0.25] and out.usage.completion_tokens == 2
        if how == "rewrite":
            await client.completions.create(model="m", prompt="another history", max_tokens=2)
        await client.completions.create(model="m", prompt=row.prompt + text + " c", max_tokens=2)
        if how == "silent":
            return None
        if how == "key":
            async with httpx.AsyncClient() as http:
                r = await http.post(base_url.split("/s/")[0] + "/reward", json={"reward": 0.25},
                                    headers={"Authorization": f"Bearer {sid}"})
                assert r.status_code == 200, r.text
            return None
        return 1.0


def _engine():
    tok = build_tokenizer()
    batches = []

    def generate(contexts, sampling):
        batches.append([list(c) for c in contexts])
        ids = tok.encode("ab", add_special_tokens=False)[:sampling.max_tokens]
        return [Completion(ids, [-0.25] * len(ids), "length", tok.decode(ids)) for _ in contexts]

    return SimpleNamespace(tokenizer=tok, version=5), generate, batches


def test_sessions_are_recorded_isolated_and_fail_alone():
    engine, generate, batches = _engine()
    tok = engine.tokenizer
    cfg = GeneratorConfig(model="/m", use_chat_template=False, session_timeout_s=1.0, max_turns=3)
    labels = ["ok", "key", "rewrite", "silent", "raise"]
    groups = [PromptGroup(i, f"q{i}=", label) for i, label in enumerate(labels)]
    server = AgentServer(_agent, {}, "127.0.0.1", 0)
    try:
        counts = Counter()
        played = server.play(groups, 2, engine, Sampling(max_tokens=4), cfg, generate, counts)
        stale = httpx.post(f"{server.url}/s/0123abcd/v1/completions", json={"prompt": "x"})
        no_key = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    finally:
        server.close()
    assert stale.status_code == 404 and "no open session" in stale.json()["error"]["message"]
    assert no_key.status_code == 404
    failed = {g.label: [e.failure.kind if e.failure else None for e in played[g.group_id]] for g in groups}
    assert failed == {"ok": [None, None], "key": [None, None], "rewrite": ["rewritten"] * 2,
                      "silent": ["expired"] * 2, "raise": ["raised"] * 2}
    assert "the agent broke" in played[4][0].failure.message
    assert counts["sessions_opened"] == 10 and counts["sessions_completed"] == 4 and counts["sessions_failed"] == 6
    assert counts["sessions_expired"] == 2 and counts["sessions_rewritten"] == 2 and counts["sessions_raised"] == 2
    ab, c = tok.encode("ab", add_special_tokens=False), tok.encode(" c", add_special_tokens=False)
    for g in groups[:2]:
        for e in played[g.group_id]:
            # the first prompt as a prompt is encoded; then "ab" sampled, " c" added, "ab" sampled
            assert e.prompt_ids == tok.encode(g.prompt) and e.ids == ab + c + ab
            assert e.mask == [1, 1, 0, 0, 1, 1] and e.logprobs == [-0.25, -0.25, 0, 0, -0.25, -0.25]
            assert e.versions == [5] * 6 and e.reward == (1.0 if g.label == "ok" else 0.25)
    assert max(len(b) for b in batches) >= 2, "the sessions' first turns did not share an engine batch"


def test_a_new_turn_is_the_template_text_after_the_models_end_of_turn():
    """Two messages appended at once (a tool result and a user message) with `tools=`: the ids
    equal the whole conversation rendered and tokenised at once, after the model's eos."""
    tok = copy.deepcopy(build_tokenizer())
    tok.chat_template = TEMPLATE
    first = [{"role": "user", "content": "2+3?"}]
    new = [{"role": "tool", "content": "5"}, {"role": "user", "content": "so?"}]
    prompt = tok.apply_chat_template(first, add_generation_prompt=True, return_dict=False)
    turn = tok.encode("x", add_special_tokens=False) + [tok.eos_token_id]
    ids, text = encode_turn(tok, new, [{"type": "function", "function": {"name": "f"}}], True)
    whole = tok.apply_chat_template(first + [{"role": "assistant", "content": "x"}] + new, add_generation_prompt=True,
                                    return_dict=False)
    assert text == "\n<tool>5</s>\n<user>so?</s>\n<assistant>"
    assert list(prompt) + turn + ids == list(whole)


def test_agent_config_errors_quote_the_key_and_value(tmp_path):
    from common.config import ConfigError, load_section

    with pytest.raises(ConfigError) as e:
        load_section(GeneratorConfig, "generator", None, ["--generator.model", "/m", "--generator.env", "guess",
                                                          "--generator.agent", "a.py:agent"])
    assert "generator.env='guess' and generator.agent='a.py:agent'" in str(e.value)
    with pytest.raises(ConfigError, match=r"generator.agent='a.py' must be path/file.py:function"):
        load_section(GeneratorConfig, "generator", None, ["--generator.model", "/m", "--generator.agent", "a.py"])
    with pytest.raises(ConfigError, match="openai_port"):
        load_section(GeneratorConfig, "generator", None, ["--generator.model", "/m",
                                                          "--generator.openai_port", "70000"])
    f = tmp_path / "agents.py"
    f.write_text("async def agent(base_url, row):\n    return 1.0\n")
    assert load_agent(f"{f}:agent")
    with pytest.raises(EnvLoadError, match=r"generator.agent='.*agents.py:nope': .* defines no 'nope'"):
        load_agent(f"{f}:nope")
    with pytest.raises(EnvLoadError, match=r"cannot take \(base_url, row\) and the agent's arguments \{'k': 1\}"):
        load_agent(f"{f}:agent", {"k": 1})
    assert load_agent("examples/agents/openai_guess.py:agent", {"max_turns": 5})


def test_a_generator_with_an_openai_agent_pushes_its_sessions_as_rollouts(tmp_path, tiny_model_dir):
    """launch.generator with `generator.agent` (examples/agents/openai_guess.py on the `openai`
    client) between a real buffer and scorer: every group comes back whole, each rollout the
    sampled guesses (mask 1) with the game's answers between them (mask 0), its reward the game's."""
    import numpy as np

    from buffer.client import BufferClient
    from common.ready import read_ready
    from demo.guess import make_problems

    rows = make_problems(4, seed=1)
    buffer, port = started(start_buffer(tmp_path, rows=rows, n_samples_per_prompt=2, prompts_per_step=4,
                                        shuffle_seed="none", lease_ttl_s=30))
    scorer, _ = start_role(tmp_path, "scorer", "scorer", port, kinds="env", poll_s=0.2)
    gen, gen_log = start_role(tmp_path, "generator", "generator", port, model=tiny_model_dir, engine="transformers",
                              worker_id="gen-agent", groups_per_lease=4, max_new_tokens=3, stop_token_ids="88",
                              use_chat_template="false", agent="examples/agents/openai_guess.py:agent",
                              max_turns=5, session_timeout_s=60)
    client = BufferClient("127.0.0.1", port, timeout_s=10)
    try:
        assert wait_exit(gen, gen_log, 120) == 0, gen_log.read_text()[-4000:]
        batch = client.get_batch(step=0, timeout_s=10)
        assert len(batch.scored) == 8 and {s.rollout.group_id for s in batch.scored} == {0, 1, 2, 3}
        for s in batch.scored:
            r = s.rollout
            assert r.action_mask is not None and r.action_mask[0] == 1 and (0 in r.action_mask or r.env_reward == 1)
            assert np.all(r.behav_logprobs[r.action_mask == 0] == 0) and (r.env_reward == 0 or 0.79 < r.env_reward <= 1)
            assert s.scores["env"] == r.env_reward
        record = read_ready(tmp_path / "generator.ready.json")  # the generator's last word, as it exited
        assert record["final"] and record["episodes"]["sessions_opened"] == 8, record
        assert record["episodes"]["sessions_completed"] == 8, record
    finally:
        client.close()
        for p in (gen, scorer, buffer):
            stop(p)


async def _stop_agent(base_url: str, row, seen: dict, **_):
    """A completion that stops at "b", then one with a malformed `stop`; what it got goes in `seen`."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
        out = await client.completions.create(model="m", prompt=row.prompt, max_tokens=4, stop=["b"])
        seen["answer"] = (out.choices[0].text, out.choices[0].finish_reason)
        try:
            await client.completions.create(model="m", prompt=row.prompt + "a", stop=[""])
        except openai.BadRequestError as e:
            seen["refused"] = str(e)
    return 1.0


def test_a_requests_stop_ends_its_turn_and_the_answer_leaves_it_out():
    """`stop` reaches the engine; the agent gets the text before it (OpenAI's rule) while the
    session records every id the engine sampled, the stop string's included."""
    tok = build_tokenizer()
    asked = []

    def generate(contexts, sampling):
        asked.append(list(sampling.stop))
        ids = tok.encode("ab", add_special_tokens=False)
        return [Completion(ids, [-0.25] * 2, "stop", "ab", stop_reason="b") for _ in contexts]

    cfg = GeneratorConfig(model="/m", use_chat_template=False, session_timeout_s=5.0, max_turns=3)
    group = PromptGroup(0, "q=", None)
    seen: dict = {}
    server = AgentServer(_stop_agent, {"seen": seen}, "127.0.0.1", 0)
    try:
        played = server.play([group], 1, SimpleNamespace(tokenizer=tok, version=1), Sampling(max_tokens=4), cfg,
                             generate, Counter())
    finally:
        server.close()
    (e,) = played[0]
    assert asked == [["b"]] and seen["answer"] == ("a", "stop")
    assert "stop=['']" in seen["refused"] and e.ids == tok.encode("ab", add_special_tokens=False) and e.mask == [1, 1]
