"""Generation engines: behaviour log-probs agree with the learner's log-prob function.

The learner computes pi_old with `learner.modeling.completion_logprobs`; the off-policy weight
pi_old / mu is only meaningful if mu (the engine's behaviour log-prob) is the same function of the
same weights. So both backends are checked against it, token by token, in fp32.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from actors.engines import TransformersEngine
from actors.engines.base import Completion, Sampling, process_logits
from learner.modeling import completion_logprobs

# DESIGN.md measured ~5e-7 between vLLM's CPU build and transformers at T=0.7 in fp32; the
# tolerance leaves room for other kernels without letting a wrong definition (e.g. a missing
# temperature, or top-p without renormalisation: errors of 1e-2 and more) through.
TOL = 1e-4

PROMPTS = ["12+34=", "hello there, how are you", "7", "The quick brown fox"]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """The transformers backend; its model doubles as the reference for log-probs."""
    engine = TransformersEngine(str(tiny_model_dir), seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    from actors.engines import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), dtype="float32", seed=0)  # with the worker extension: it loads rounds
    yield engine
    engine.close()


def _prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def _flat(prompt_ids, groups: list[list[Completion]]):
    prompts = [p for p, g in zip(prompt_ids, groups) for _ in g]
    comps = [c for g in groups for c in g]
    return prompts, comps


def _max_gap(reference: list[torch.Tensor], comps: list[Completion]) -> float:
    gaps = [(r - torch.tensor(c.logprobs)).abs().max().item() for r, c in zip(reference, comps) if c.token_ids]
    return max(gaps)


def _processed_reference(model, prompts, comps, s: Sampling) -> list[torch.Tensor]:
    """log_softmax of the temperature-scaled, top-k/top-p masked logits at each sampled token,
    from one full forward pass per sequence (no KV cache)."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, comps):
            ids = torch.tensor([list(p) + c.token_ids])
            logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]  # (T, V) predicting each completion token
            lp = F.log_softmax(process_logits(logits, s.temperature, s.top_k, s.top_p), dim=-1)
            out.append(lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0])
    return out


def _check_shapes(groups, n, s: Sampling, tokenizer):
    assert len(groups) == len(PROMPTS)
    for g in groups:
        assert len(g) == n
        for c in g:
            assert 1 <= len(c.token_ids) <= s.max_tokens
            assert len(c.logprobs) == len(c.token_ids)
            assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.token_ids) == s.max_tokens
            assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_process_logits_by_hand():
    # probs 0.1 0.2 0.3 0.4. top_p=0.5: ascending cumulative 0.1 0.3 0.6 1.0; tokens whose
    # cumulative sum stays <= 1-0.5 are dropped (0.1 and 0.2), the rest renormalised: 3/7, 4/7.
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
    lp = F.log_softmax(process_logits(logits, 1.0, top_p=0.5), -1)[0]
    assert lp[0] == -math.inf and lp[1] == -math.inf
    assert torch.allclose(lp[2:].exp(), torch.tensor([3 / 7, 4 / 7]))
    # top_k=3 keeps 0.2 0.3 0.4 -> /0.9
    lp = F.log_softmax(process_logits(logits, 1.0, top_k=3), -1)[0]
    assert torch.allclose(lp.exp(), torch.tensor([0.0, 2 / 9, 3 / 9, 4 / 9]))
    # T=0.5 squares the probabilities before renormalising: 0.01 0.04 0.09 0.16 over 0.30
    lp = F.log_softmax(process_logits(logits, 0.5), -1)[0]
    assert torch.allclose(lp.exp(), torch.tensor([1, 4, 9, 16]) / 30.0)
    # greedy leaves the logits alone
    assert torch.equal(process_logits(logits, 0.0, top_k=1, top_p=0.1), logits)


def test_transformers_logprobs_match_learner(hf):
    ids = _prompt_ids(hf.tokenizer)
    s = Sampling(temperature=0.7, max_tokens=24, seed=1)
    groups = hf.generate(ids, 3, s)
    _check_shapes(groups, 3, s, hf.tokenizer)
    prompts, comps = _flat(ids, groups)
    ref = completion_logprobs(hf.model, prompts, [c.token_ids for c in comps], temperature=0.7)
    gap = _max_gap(ref, comps)
    assert gap < TOL, f"transformers backend vs completion_logprobs: largest gap {gap:.3g} >= {TOL}"
    # samples differ within a group (it is sampling, not n copies of one completion)
    assert len({tuple(c.token_ids) for c in groups[0]}) > 1

    s = Sampling(temperature=0.8, top_k=20, top_p=0.9, max_tokens=24, seed=2)
    groups = hf.generate(ids, 3, s)
    prompts, comps = _flat(ids, groups)
    gap = _max_gap(_processed_reference(hf.model, prompts, comps, s), comps)
    assert gap < TOL, f"transformers backend with top-k/top-p vs renormalised log-probs: largest gap {gap:.3g}"


@pytest.mark.slow
def test_vllm_logprobs_match_learner(vllm_engine, hf):
    ids = _prompt_ids(vllm_engine.tokenizer)
    s = Sampling(temperature=0.7, max_tokens=32, seed=3)
    groups = vllm_engine.generate(ids, 4, s)
    _check_shapes(groups, 4, s, vllm_engine.tokenizer)
    prompts, comps = _flat(ids, groups)
    ref = completion_logprobs(hf.model, prompts, [c.token_ids for c in comps], temperature=0.7)
    gap = _max_gap(ref, comps)
    print(f"vLLM vs completion_logprobs at T=0.7: largest gap {gap:.3g}")
    assert gap < TOL, f"vLLM behaviour log-probs vs completion_logprobs at T=0.7: largest gap {gap:.3g} >= {TOL}"


@pytest.mark.slow
def test_vllm_top_k_top_p_logprobs_are_renormalised(vllm_engine, hf):
    ids = _prompt_ids(vllm_engine.tokenizer)
    s = Sampling(temperature=0.8, top_k=20, top_p=0.9, max_tokens=32, seed=4)
    groups = vllm_engine.generate(ids, 4, s)
    _check_shapes(groups, 4, s, vllm_engine.tokenizer)
    prompts, comps = _flat(ids, groups)
    gap = _max_gap(_processed_reference(hf.model, prompts, comps, s), comps)
    print(f"vLLM vs renormalised log-probs (T=0.8, top_k=20, top_p=0.9): largest gap {gap:.3g}")
    assert gap < TOL, f"vLLM log-probs with top-k/top-p vs renormalised reference: largest gap {gap:.3g} >= {TOL}"
    # The filters matter here: without renormalisation every log-prob would be lower.
    plain = completion_logprobs(hf.model, prompts, [c.token_ids for c in comps], temperature=0.8)
    lift = min((torch.tensor(c.logprobs) - r).min().item() for r, c in zip(plain, comps))
    assert lift > 1e-3, f"top-k/top-p did not renormalise (smallest lift {lift:.3g})"


@pytest.mark.slow
def test_greedy_is_identical_across_backends(vllm_engine, hf):
    ids = _prompt_ids(vllm_engine.tokenizer)
    s = Sampling(temperature=0.0, max_tokens=32)
    a = vllm_engine.generate(ids, 1, s)
    b = hf.generate(ids, 1, s)
    for p, ga, gb in zip(PROMPTS, a, b):
        assert ga[0].token_ids == gb[0].token_ids, f"greedy continuations of {p!r} differ"
        assert ga[0].finish_reason == gb[0].finish_reason
    prompts, comps = _flat(ids, a)
    gap = _max_gap(_processed_reference(hf.model, prompts, comps, s), comps)
    assert gap < TOL, f"greedy log-probs (log_softmax of raw logits): largest gap {gap:.3g}"


def test_a_completion_cut_at_its_budget_is_the_one_sampled_with_that_budget(vllm_engine):
    """generator.max_len: a batch samples with its largest budget, and each completion is cut at its own
    (actors/generator.py `cut`); greedy, the cut one equals the one sampled with the smaller budget."""
    from actors.generator import cut

    ids = _prompt_ids(vllm_engine.tokenizer)
    long = vllm_engine.generate(ids, 1, Sampling(temperature=0.0, max_tokens=12))
    short = vllm_engine.generate(ids, 1, Sampling(temperature=0.0, max_tokens=3))
    for (a,), (b,) in zip(long, short):
        c = cut(a, 3, vllm_engine.tokenizer)
        assert (c.token_ids, c.finish_reason, c.text) == (b.token_ids, b.finish_reason, b.text)
        assert c.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert cut(a, 12, vllm_engine.tokenizer) is a  # within its budget: as it was


@pytest.mark.slow
def test_stop_strings_end_a_completion_on_the_token_that_completes_them(vllm_engine, hf):
    """Both engines stop where the text first holds a stop string: the ids are the unstopped
    greedy ids up to the token that completes it (kept whole), the text ends with the string."""
    ids = _prompt_ids(vllm_engine.tokenizer)
    tok = vllm_engine.tokenizer
    full = [g[0] for g in vllm_engine.generate(ids, 1, Sampling(temperature=0.0, max_tokens=24))]
    i = max(range(len(full)), key=lambda j: len(full[j].text))
    text = full[i].text
    assert len(text) >= 8, f"the greedy continuation of {PROMPTS[i]!r} is too short to cut: {text!r}"
    stop = text[5:8]
    end = text.find(stop) + len(stop)
    k = next(k for k in range(1, len(full[i].token_ids) + 1)
             if stop in tok.decode(full[i].token_ids[:k], skip_special_tokens=True))
    s = Sampling(temperature=0.0, max_tokens=24, stop=["never-in-this-text", stop])
    for engine in (vllm_engine, hf):
        c = engine.generate([ids[i]], 1, s)[0][0]
        assert c.token_ids == full[i].token_ids[:k], type(engine).__name__
        assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, text[:end]), type(engine).__name__
        assert max(abs(a - b) for a, b in zip(c.logprobs, full[i].logprobs)) < TOL


def test_generator_config_errors_quote_the_values():
    from actors.config import GeneratorConfig
    from common.config import ConfigError, load_section

    cfg = load_section(GeneratorConfig, "generator", None,
                       ["--generator.model", "/m", "--generator.stop_token_ids", "2,7"])
    assert cfg.stop_token_ids == [2, 7] and cfg.engine == "vllm"
    with pytest.raises(ConfigError) as e:
        load_section(GeneratorConfig, "generator", None,
                     ["--generator.model", "/m", "--generator.top_p", "1.5", "--generator.max_model_len", "64",
                      "--generator.prompt_max_len", "60"])
    msg = str(e.value)
    assert "generator.top_p=1.5" in msg and "prompt_max_len=60 + max_new_tokens=128 exceeds max_model_len=64" in msg
    with pytest.raises(ConfigError, match="'sglang' is not one of"):
        load_section(GeneratorConfig, "generator", None, ["--generator.model", "/m", "--generator.engine", "sglang"])


# ---------------------------------------------------------------------------------------------
# weights: an engine owns its version


def _disk_round(folder, named: dict, version: int, round_id: int = 1, saved: dict | None = None):
    """A weight-sync round of the disk backend announcing `named`, its folder holding `saved`
    (default: `named`, as the sender writes it)."""
    from safetensors.torch import save_file

    from weight_sync import buckets as bk
    from weight_sync.messages import RoundInfo

    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in (named if saved is None else saved).items()},
              str(folder / "model.safetensors"))
    manifest = bk.plan(bk.specs_of(named.items())[0], 1 << 20)
    return RoundInfo(round_id, version, "disk", "finish", 10.0, False, manifest, path=str(folder))


def test_transformers_engine_stamps_the_version_of_the_round_it_loaded(tmp_path, tiny_model_dir):
    """A loaded round sets the engine's version (what the generator stamps on tokens); a round
    that goes on without it leaves weights and version as they were."""
    from weight_sync.receiver import RoundMissed

    engine = TransformersEngine(str(tiny_model_dir), seed=0)
    try:
        assert engine.version == 0
        sent = {n: p.detach() * 0.5 for n, p in engine.model.named_parameters()}
        stats = engine.receive_weights(_disk_round(tmp_path / "v7", sent, 7))
        assert engine.version == 7 and stats["version"] == 7
        assert all(torch.equal(p, sent[n]) for n, p in engine.model.named_parameters())
        # a round naming a tensor its folder lacks: missed, nothing loaded
        info = _disk_round(tmp_path / "v8", {"missing": torch.ones(2)}, 8, 2, saved={"other": torch.ones(2)})
        with pytest.raises(RoundMissed):
            engine.receive_weights(info)
        assert engine.version == 7
        assert all(torch.equal(p, sent[n]) for n, p in engine.model.named_parameters())
    finally:
        engine.close()


@pytest.mark.slow
def test_vllm_engine_loads_a_round_and_stamps_its_version(vllm_engine, hf, tmp_path):
    """The round crosses collective_rpc as a plain map into the worker extension; the engine then
    generates with the new weights and says which version they are. (Last in this module: it
    puts the original weights back at the end.)"""
    ids = _prompt_ids(vllm_engine.tokenizer)
    s = Sampling(temperature=0.0, max_tokens=16)
    before = [g[0].token_ids for g in vllm_engine.generate(ids, 1, s)]
    original = {n: p.detach().clone() for n, p in hf.model.named_parameters()}
    flipped = {n: -t for n, t in original.items()}  # another model: greedy continuations change
    vllm_engine.receive_weights(_disk_round(tmp_path / "v3", flipped, 3))
    assert vllm_engine.version == 3
    assert [g[0].token_ids for g in vllm_engine.generate(ids, 1, s)] != before
    vllm_engine.receive_weights(_disk_round(tmp_path / "v4", original, 4, round_id=2))
    assert vllm_engine.version == 4
    assert [g[0].token_ids for g in vllm_engine.generate(ids, 1, s)] == before


# ---- multi-turn episodes (actors/envs/episodes.py) on the running vLLM engine ------------------------


class _Counter:
    """A scripted environment: answers `ok <turn>` twice, then says done; reward 0.5 per step.
    `raise_on`: the sample index whose environment raises at its second step; `slow_on`: the one
    whose every step takes a second (asleep, as an environment waiting on a tool does)."""

    made: list = []

    def __init__(self, raise_on: int = -1, slow_on: int = -1):
        self.index = len(self.made)
        self.made.append(self)
        self.raise_on, self.slow_on, self.turn, self.done_at = raise_on, slow_on, 0, []

    async def reset(self, row):
        return None

    async def step(self, action):
        import asyncio

        self.turn += 1
        if self.index == self.slow_on:
            await asyncio.sleep(1.0)
        if self.index == self.raise_on and self.turn == 2:
            raise RuntimeError("the environment broke")
        self.done_at.append(time.monotonic())
        return (f" ok {self.turn}.", 0.5, self.turn == 3, {})


def _play(vllm_engine, tiny_model_dir, n: int, raise_on: int = -1, max_turns: int = 3, slow_on: int = -1):
    from collections import Counter

    from actors.config import GeneratorConfig
    from actors.envs.episodes import run_episodes
    from buffer.messages import PromptGroup

    _Counter.made.clear()
    cfg = GeneratorConfig(model=str(tiny_model_dir), max_turns=max_turns, max_new_tokens=4, use_chat_template=False,
                          env_timeout_s=10.0)
    turns = []  # every batch the engine sampled, as it returned it

    def generate(contexts, turn):
        out = [c[0] for c in vllm_engine.generate(contexts, 1, turn)]
        turns.append((contexts, out))
        return out

    prompt = vllm_engine.tokenizer.encode("12+34=")
    counts = Counter()
    played = run_episodes([PromptGroup(7, "12+34=", "46")], [prompt], n, vllm_engine,
                          Sampling(temperature=1.0, max_tokens=4, seed=3), cfg, lambda: _Counter(raise_on, slow_on),
                          generate, counts)
    return played[7], turns, prompt, counts


@pytest.mark.slow
def test_a_multi_turn_episode_is_the_policys_ids_and_the_environments_ids_as_they_were(vllm_engine, hf, tiny_model_dir):
    """Three turns against a scripted environment: the rollout's completion is, id for id, what the
    engine sampled each turn with the environment's encoded answers between them (never the text
    re-tokenised); the mask marks the engine's; its behaviour log-probs are the learner's log-probs
    of the policy's tokens in that context; the reward is the environment's."""
    from actors.envs.api import encode_observation
    from actors.envs.episodes import rollout_of

    episodes, turns, prompt, counts = _play(vllm_engine, tiny_model_dir, n=2)
    tok = vllm_engine.tokenizer
    assert len(turns) == 3 and counts["episodes_failed"] == 0
    for j, e in enumerate(episodes):
        want, mask = [], []
        for t, (contexts, out) in enumerate(turns):
            assert contexts[j] == prompt + want  # each turn sampled from exactly the ids so far
            want += out[j].token_ids
            mask += [1] * len(out[j].token_ids)
            if t < 2:
                obs = encode_observation(tok, f" ok {t + 1}.", "user", use_chat_template=False)
                want += obs
                mask += [0] * len(obs)
        r = rollout_of(e, lease_id=1, worker_id="w")
        assert r.completion_ids.tolist() == want and r.action_mask.tolist() == mask
        assert r.env_reward == 1.5 and r.finish_reason == "stop" and r.prompt_ids.tolist() == prompt
        assert (r.behav_logprobs[r.action_mask == 0] == 0).all()
        learner = completion_logprobs(hf.model, [prompt], [want])[0]  # the learner's log-probs, fp32
        gap = (learner - torch.tensor(r.behav_logprobs))[torch.tensor(mask, dtype=torch.bool)].abs().max().item()
        assert gap < TOL, gap


@pytest.mark.slow
def test_a_broken_environment_fails_its_episode_only_and_turns_are_bounded(vllm_engine, tiny_model_dir):
    episodes, _, _, counts = _play(vllm_engine, tiny_model_dir, n=3, raise_on=1)
    assert [e.failure is not None for e in episodes] == [False, True, False]
    assert episodes[1].failure.kind == "raised" and "the environment broke" in episodes[1].failure.message
    assert counts["episodes_failed"] == 1 and [e.finish for e in episodes] == ["stop", "", "stop"]
    episodes, turns, _, counts = _play(vllm_engine, tiny_model_dir, n=2, max_turns=2)
    assert len(turns) == 2 and [e.finish for e in episodes] == ["length"] * 2 and counts["episodes_truncated"] == 2
    # a slow environment holds back its own episode only: the others play all three turns meanwhile
    episodes, _, _, _ = _play(vllm_engine, tiny_model_dir, n=3, slow_on=0)
    slow, *fast = _Counter.made
    assert [e.finish for e in episodes] == ["stop"] * 3
    assert max(t for f in fast for t in f.done_at) < slow.done_at[0], "a fast episode waited for the slow one"



# ---- the OpenAI endpoint for agent code (actors/agents/openai_server.py) on the running vLLM engine ---------


_ADDED: dict = {}  # session id -> the texts its agent added, in order


async def _openai_agent(base_url: str, row):
    """Three requests through the `openai` client, adding the session's own id between them (so
    sessions that mixed would show it), by completions or chat as the row's label says; the
    labels rewrite, silent and raise break the session as they say."""
    import openai

    sid = base_url.split("/s/")[1].split("/")[0]
    added = _ADDED.setdefault(sid, [])
    async with openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
        if row.label == "raise":
            raise RuntimeError("the agent broke")
        if row.label == "chat":
            messages = [{"role": "user", "content": row.prompt}]
            for turn in range(3):
                out = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
                added.append(f" {sid[:4]} {turn}")
                messages += [{"role": "assistant", "content": out.choices[0].message.content},
                             {"role": "user", "content": added[-1]}]
            return 0.5
        prompt = row.prompt
        for turn in range(3):
            out = await client.completions.create(model="m", prompt=prompt, max_tokens=4, logprobs=0)
            added.append(f" {sid[:4]} {turn}")
            prompt += out.choices[0].text + added[-1]
            if row.label == "rewrite":
                prompt = "12+34=" + prompt[7:]
        return None if row.label == "silent" else 1.0


@pytest.mark.slow
def test_openai_endpoint_records_the_engines_ids_and_the_agents_exactly(vllm_engine, hf, tiny_model_dir):
    """Agents on the `openai` client, over real HTTP, two sessions per prompt at once: each session's
    rollout is, id for id, what the engine sampled for it with its own agent's added ids between
    (completions: the new text's ids; chat: the template's ids after the model's end-of-turn), its
    log-probs the learner's; a rewritten history gets 400, a session that never reports expires,
    an agent that raises fails its own group; all counted."""
    from collections import Counter

    from transformers import AutoTokenizer

    from actors.agents.openai_server import AgentServer
    from actors.config import GeneratorConfig
    from actors.envs.episodes import rollout_of
    from buffer.messages import PromptGroup

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # the engine's, with a chat template (its own has none)
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    cfg = GeneratorConfig(model=str(tiny_model_dir), max_new_tokens=4, max_turns=4, session_timeout_s=60.0)
    turns = []

    def generate(contexts, turn):
        out = [c[0] for c in vllm_engine.generate(contexts, 1, turn)]
        turns.append((contexts, out))
        return out

    labels = ["text", "chat", "rewrite", "raise", "silent"]
    groups = [PromptGroup(i, f"{i}+{i}=", label) for i, label in enumerate(labels)]
    _ADDED.clear()
    server = AgentServer(_openai_agent, {}, tokenizer=tok)
    sampling = Sampling(temperature=1.0, max_tokens=4, seed=3)
    try:
        counts = Counter()
        played = server.play(groups[:4], 2, vllm_engine, sampling, cfg, generate, counts)
        # the silent one in a lease of its own, with a short timeout (the others' run time is the machine's)
        silent = server.play(groups[4:], 1, vllm_engine, sampling, cfg.model_copy(update={"session_timeout_s": 0.5}),
                             generate, counts)[4]
    finally:
        server.close()
    failed = [[e.failure.kind if e.failure else None for e in played[g.group_id]] for g in groups[:4]]
    assert failed == [[None] * 2, [None] * 2, ["rewritten"] * 2, ["raised"] * 2], [
        e.failure.message for g in groups[:2] for e in played[g.group_id] if e.failure]
    assert silent[0].failure.kind == "expired" and silent[0].turns == 3
    assert counts["sessions_opened"] == 9 and counts["sessions_completed"] == 4 and counts["sessions_failed"] == 5
    assert counts["sessions_expired"] == 1 and counts["sessions_rewritten"] == 2 and counts["sessions_raised"] == 2
    assert any(len(contexts) >= 4 for contexts, _ in turns), "the sessions did not share engine batches"
    eos = tok.eos_token_id
    for g in groups[:2]:
        for e in played[g.group_id]:
            sid = next(s for s in _ADDED if f" {s[:4]} 0" in e.texts[1])  # (the session's first addition)
            r = rollout_of(e, lease_id=1, worker_id="w")
            prompt = r.prompt_ids.tolist()
            if g.label == "chat":
                assert prompt == list(tok.apply_chat_template([{"role": "user", "content": g.prompt}],
                                                              add_generation_prompt=True, return_dict=False))
            else:
                assert prompt == tok.encode(g.prompt)
            want, mask, k = [], [], 0
            for contexts, out in turns:
                for context, c in zip(contexts, out):
                    if context != prompt + want:
                        continue
                    want += c.token_ids
                    mask += [1] * len(c.token_ids)
                    if k < 2:  # the agent's addition before the next request (none after the last)
                        text = _ADDED[sid][k] if g.label == "text" else f"\n<user>{_ADDED[sid][k]}</s>\n<assistant>"
                        added = ([eos] if g.label == "chat" and want[-1] != eos else []) + tok.encode(
                            text, add_special_tokens=False)
                        want += added
                        mask += [0] * len(added)
                    k += 1
            assert k == 3 and r.completion_ids.tolist() == want and r.action_mask.tolist() == mask
            assert r.env_reward == (1.0 if g.label == "text" else 0.5) and r.finish_reason == "stop"
            learner = completion_logprobs(hf.model, [prompt], [want])[0]
            gap = (learner - torch.tensor(r.behav_logprobs))[torch.tensor(mask, dtype=torch.bool)].abs().max().item()
            assert gap < TOL, gap
            assert (r.behav_logprobs[r.action_mask == 0] == 0).all()
