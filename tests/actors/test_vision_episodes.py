"""Multi-turn episodes with images: an environment's observation shows images (actors/envs/api.py,
actors/envs/images.py, actors/envs/episodes.py).

The engine is given each turn's context with one `<|image_pad|>` per image and every image so far;
the rollout holds the context with each pad expanded to its image's tokens, observations' tokens
masked out, and the prompt's images then the observations'. The unit tests check the expansion,
the API's checks and the episode loop with a fake engine that expands as the tiny model's processor
does (a 56x56 picture: 4 tokens). The live tests play two-turn episodes on one vLLM engine shared by
the module and check the rollouts against the model's processor and the learner's log-probs.
Pictures are of three sizes: 56x56 (4 image tokens), 112x56 (8) and 84x84 (9).
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actors.config import GeneratorConfig
from actors.engines.base import Completion, Engine, Sampling
from actors.envs.agent_executor import ExecutorEpisodes
from actors.envs.api import BadReturn, Environment, StepResult, check_step, encode_observation, run_step
from actors.envs.episodes import rollout_of, run_episodes
from actors.envs.images import ImageTokens, expand, first_difference
from actors.envs.openrlhf_agent import AgentInstanceBase, OpenRLHFAgent
from actors.generator import Counters, make_rollouts
from actors.prompts import IMAGE_PAD, IMAGE_TEXT, VIDEO_PAD, encode_prompt
from buffer.messages import LeaseGrant, PromptGroup
from common.images import pil_image, text_to_parts
from tests.helpers.vision import picture

TOL = 1e-4
OBSERVATION = "\nuser: <image>What now?\nassistant: "  # written as the tiny model's template writes a user turn


class PictureEnv(Environment):
    """Shows `shown` after the policy's first turn (OBSERVATION's text, written in the tiny model's
    chat markup: role None), says done after the second; reward 1 at the end."""

    observation_role = None

    def __init__(self, shown: list[bytes], text: str = OBSERVATION, turns: int = 2):
        self.shown, self.text, self.turns, self.turn = shown, text, turns, 0
        self.actions: list[str] = []

    async def step(self, action: str) -> StepResult:
        self.actions.append(action)
        self.turn += 1
        if self.turn < self.turns:
            return StepResult(self.text, 0.0, False, {}, self.shown)
        return StepResult("", 1.0, True, {})


def collapsed(ids, pad: int) -> list[int]:
    """Ids with each run of pads one pad (the engine's view of a rollout whose images never touch)."""
    return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]


# ------------------------------------------------------------------------------------------------
# the expansion (no engine)


def test_expand_repeats_each_pad_as_often_as_its_image_has_tokens():
    # pad 9: [1, 9, 2, 9] with images of 4 and 2 tokens -> 1, four 9s, 2, two 9s
    assert expand([1, 9, 2, 9], 9, [4, 2]) == [1, 9, 9, 9, 9, 2, 9, 9]
    assert expand([1, 2], 9, []) == [1, 2]
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) in the ids for 1 image"):
        expand([9, 9], 9, [4])
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_image_tokens_are_the_processors(vlm_dir, tok, processor, pics):
    tokens = ImageTokens(str(vlm_dir))
    assert tokens.sizes([pics["a"], pics["wide"], pics["big"], pics["a"]]) == [4, 8, 9, 4]
    images = [pics["wide"], pics["big"]]
    sent = encode_prompt(tok, "<image> then <image>?", True, images=images)
    parts = [{"role": "user", "content": text_to_parts("<image> then <image>?")}]
    text = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    want = processor(text=[text], images=[pil_image(b) for b in images], add_special_tokens=False)["input_ids"][0]
    assert tokens.expand(sent, images) == list(want)


# ------------------------------------------------------------------------------------------------
# the API: an observation's images


def test_an_observation_takes_images_in_every_form_and_marks_where_they_stand(pics):
    from PIL import Image

    png = pics["a"]
    forms = [png, Image.open(io.BytesIO(png)), base64.b64encode(png).decode(),
             "data:image/png;base64," + base64.b64encode(png).decode(), {"bytes": png}]
    for form in forms:
        res = check_step(("Look: <image>", 0, False, None, [form]))
        assert res.observation == "Look: <image>" and len(res.images) == 1
        assert pil_image(res.images[0]).size == (56, 56) and isinstance(res.images[0], bytes)
    # one image, not in a list; no marker: at the start, one per image
    assert check_step(StepResult("Look.", 0.0, False, None, png)) == StepResult("<image>Look.", 0.0, False, {}, [png])
    assert check_step(("Look.", 0, False, {}, [png, png])).observation == "<image><image>Look."
    # no images: a text observation, "<image>" in it plain text
    assert check_step(("<image>", 0, False, {})) == StepResult("<image>", 0.0, False, {}, None)
    assert check_step(("o", 0, False, {}, [])).images is None
    with pytest.raises(BadReturn, match=r"2 <image> marker\(s\) for its 1 image"):
        check_step(("<image> and <image>", 0, False, {}, [png]))
    with pytest.raises(BadReturn, match=r"images\[1\] that cannot be used: not an image file"):
        check_step(("o", 0, False, {}, [png, b"not a picture"]))
    with pytest.raises(BadReturn, match=r"StepResult\(observation, reward, done, info\[, images\]\)"):
        check_step(("o", 0, False, {}, [png], "extra"))
    # through run_step: a bad image fails the step as a bad return, counted
    counts = Counter()

    class Broken(Environment):
        def step(self, action):
            return "o", 0.0, False, {}, ["no/such/file.png"]

    failed = asyncio.run(run_step(Broken(), "a", 1.0, counts))
    assert failed.kind == "bad_return" and "images[0]" in failed.message and counts == {"bad_return": 1}


def test_an_observation_with_images_is_encoded_with_one_pad_each(tok, pics):
    from demo.tiny_vlm import CHAT_TEMPLATE

    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    # role None: the text itself, each marker written as the image's tokens
    ids = encode_observation(tok, OBSERVATION, None, images=1)
    assert ids == tok.encode(OBSERVATION.replace("<image>", IMAGE_TEXT), add_special_tokens=False)
    assert ids.count(pad) == 1
    # a role, through the template: the ids equal the whole conversation's, rendered with its image parts
    # (this template ends an assistant message with the eos, as chat templates end turns)
    templated = tok.__class__.from_pretrained(tok.name_or_path)
    templated.chat_template = CHAT_TEMPLATE.replace("{% endif %}{{ '\\n' }}{% endfor %}",
                                                    "{% endif %}{% if m['role'] == 'assistant' %}</s>{% endif %}"
                                                    "{{ '\\n' }}{% endfor %}")
    chat = [{"role": "user", "content": text_to_parts("<image>Count.")}]
    whole = templated.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    whole += templated.encode("3", add_special_tokens=False) + [templated.eos_token_id]
    whole += encode_observation(templated, "<image>and <image>?", "user", images=2)
    chat += [{"role": "assistant", "content": "3"}, {"role": "user", "content": text_to_parts("<image>and <image>?")}]
    assert whole == templated.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert whole.count(pad) == 3


def test_an_openrlhf_agents_environment_images_join_its_feedback(pics):
    class Screens(AgentInstanceBase):
        def __init__(self, **kwargs):
            pass

        async def step(self, states, **kwargs):  # as OpenRLHF's examples/python/vlm_multiturn_agent.py writes it
            return {"rewards": 0.0, "done": False, "environment_images": [pil_image(pics["a"])],
                    "environment_feedback": f"\nuser: {IMAGE_TEXT}\nWhat now?\nassistant: "}

    env = OpenRLHFAgent(Screens)
    asyncio.run(env.reset(SimpleNamespace(prompt="p", label="l")))
    res = asyncio.run(run_step(env, "a", 1.0))
    assert res.observation == "\nuser: <image>\nWhat now?\nassistant: " and len(res.images) == 1
    assert np.array_equal(np.asarray(pil_image(res.images[0])), np.asarray(pil_image(pics["a"])))
    # what the agent's next step sees is the text as it wrote it, placeholder and all
    assert env.observation_text == f"pa\nuser: {IMAGE_TEXT}\nWhat now?\nassistant: "


# ------------------------------------------------------------------------------------------------
# the episode loop with a fake engine


class FakeEngine(Engine):
    """Answers every context with `answer` (the tokens of "ok" and the eos by default); a context
    with images comes back with each pad expanded `per_pad` times (4: a 56x56 picture's tokens).
    Records each call's contexts and images."""

    def __init__(self, tokenizer, per_pad: int = 4, vision: bool = True, answer: list[int] | None = None):
        self.tokenizer, self.per_pad, self.calls = tokenizer, per_pad, []
        self.pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.placeholder_ids = (self.pad, tokenizer.convert_tokens_to_ids(VIDEO_PAD)) if vision else ()
        self.answer = answer or tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.eos_token_id]

    def generate(self, prompt_ids, n, sampling, images=None):
        self.calls.append(([list(p) for p in prompt_ids], images))
        out = []
        for p, imgs in zip(prompt_ids, images or [None] * len(prompt_ids)):
            expanded = [t for i in p for t in ([i] * self.per_pad if i == self.pad else [i])] if imgs else None
            out.append([Completion(list(self.answer), [-0.5] * len(self.answer), "stop",
                                   self.tokenizer.decode(self.answer, skip_special_tokens=True),
                                   prompt_ids=expanded) for _ in range(n)])
        return out

    def receive_weights(self, info):
        raise NotImplementedError


def play(engine, groups, cfg, make_env, n: int = 1):
    tok = engine.tokenizer
    prompts = [encode_prompt(tok, g.prompt, cfg.use_chat_template, images=g.images) for g in groups]
    counts = Counter()
    played = run_episodes(groups, prompts, n, engine, Sampling(max_tokens=4), cfg, make_env,
                          lambda contexts, s, images=None: [c[0] for c in engine.generate(contexts, 1, s, images)],
                          counts)
    return [e for g in groups for e in played[g.group_id]], prompts, counts


def test_an_image_observation_is_given_to_the_engine_as_one_pad_and_expanded_in_the_rollout(vlm_dir, tok, pics):
    engine = FakeEngine(tok)
    cfg = GeneratorConfig(model=str(vlm_dir), max_turns=2, max_new_tokens=4, max_images_per_prompt=2)
    groups = [PromptGroup(0, "<image>How many?", "3", images=[pics["a"]]), PromptGroup(1, "Look.", "")]
    episodes, prompts, counts = play(engine, groups, cfg, lambda: PictureEnv([pics["b"]]))
    assert all(e.failure is None and e.finish == "stop" and e.turns == 2 for e in episodes), episodes
    pad, answer = engine.pad, engine.answer
    obs = encode_observation(tok, OBSERVATION, None, images=1)  # one pad: the engine's view
    assert obs.count(pad) == 1
    # turn 1: the prompts as encoded (the image prompt's one pad, its image; the text prompt without);
    # turn 2: every image so far, each still one pad in the context
    sent = [(c, i) for contexts, images in engine.calls for c, i in zip(contexts, images or [None] * len(contexts))]
    assert sorted(sent, key=lambda x: len(x[0])) == [
        (prompts[1], None), (prompts[0], [pics["a"]]),
        (prompts[1] + answer + obs, [pics["b"]]), (prompts[0] + answer + obs, [pics["a"], pics["b"]])]
    assert len(prompts[0]) < len(prompts[1] + answer + obs)  # (the order sorted above)
    four = expand(obs, pad, [4])
    for e, prompt, images in zip(episodes, prompts, ([pics["a"], pics["b"]], [pics["b"]])):
        r = rollout_of(e, 5, "g")
        assert r.images == images
        assert r.prompt_ids.tolist() == expand(prompt, pad, [4] * prompt.count(pad))
        assert r.completion_ids.tolist() == answer + four + answer
        # the observation (its expanded image included) is the environment's: mask 0, log-prob 0
        t = len(answer)
        assert r.action_mask.tolist() == [1] * t + [0] * len(four) + [1] * t
        assert r.behav_logprobs.tolist() == [-0.5] * t + [0.0] * len(four) + [-0.5] * t
        assert r.completion == "ok" + OBSERVATION + "ok" and r.env_reward == 1.0
    assert not counts["refused"] and not counts["episodes_failed"]


def test_an_episode_the_engine_or_the_limits_cannot_take_fails_with_the_reason(vlm_dir, tok, pics):
    cfg = GeneratorConfig(model=str(vlm_dir), max_turns=2, max_new_tokens=4, max_images_per_prompt=2)
    image_group = [PromptGroup(0, "<image>How many?", "3", images=[pics["a"]])]
    cases = [  # (engine, groups, environment, what the failure says)
        (FakeEngine(tok), image_group, lambda: PictureEnv([pics["b"], pics["a"]], "<image><image>"),
         "3 images in the episode (the prompt's and the observations') > generator.max_images_per_prompt=2"),
        (FakeEngine(tok, vision=False), [PromptGroup(1, "Look.", "")], lambda: PictureEnv([pics["b"]]),
         "an observation with 1 image(s), but the policy is a text model"),
        (FakeEngine(tok), [PromptGroup(1, "Look.", "")], lambda: PictureEnv([], f"see {IMAGE_TEXT}"),
         f"the observation's ids hold 1 image placeholder(s) ({IMAGE_PAD}) for its 0 image(s)"),
        (FakeEngine(tok, per_pad=5), image_group, lambda: PictureEnv([pics["b"]]),
         "the engine expanded the context's 1 image(s) to "),
        (FakeEngine(tok, answer=[tok.convert_tokens_to_ids(IMAGE_PAD), 5]), image_group, lambda: PictureEnv([]),
         "a turn began with an image placeholder token"),
    ]
    for engine, groups, make_env, why in cases:
        [e], _, counts = play(engine, groups, cfg, make_env)
        assert e.failure is not None and e.failure.kind == "refused" and why in e.failure.message, (why, e.failure)
        assert counts["refused"] == 1 and counts["episodes_failed"] == 1
    # within the limit: the same episode that shows one picture plays to its end
    [e], _, _ = play(FakeEngine(tok), image_group, cfg, lambda: PictureEnv([pics["b"]]))
    assert e.failure is None and len(e.images) == 2
    # a turn that samples a placeholder after other tokens ends before it
    five, pad = tok.convert_tokens_to_ids("5"), tok.convert_tokens_to_ids(IMAGE_PAD)
    [e], _, _ = play(FakeEngine(tok, answer=[five, pad, five]), image_group, cfg, lambda: PictureEnv([]))
    assert e.failure is None and e.ids[:1] == [five] and e.ids.count(pad) == 0 and e.mask[0] == 1


def test_make_rollouts_plays_image_groups_with_an_environment_and_refuses_them_to_an_executor(vlm_dir, tok, pics):
    failed = {}
    client = SimpleNamespace(group_failed=lambda lease, group, why: failed.setdefault(group, why))
    cfg = GeneratorConfig(model=str(vlm_dir), max_turns=2, max_new_tokens=4, max_images_per_prompt=2)
    groups = [PromptGroup(0, "<image>How many?", "3", images=[pics["a"]]),
              PromptGroup(1, "<image><image><image>", "", images=[pics["a"]] * 3)]  # past the limit at the start
    grant = LeaseGrant(lease_id=4, groups=groups, n_samples=2, ttl_s=60.0, version=0)
    counts = Counters()
    rollouts = make_rollouts(grant, cfg, FakeEngine(tok), Sampling(max_tokens=4), client, "g", counts,
                             factory=lambda: PictureEnv([pics["b"]]))
    assert [r.group_id for r in rollouts] == [0, 0] and all(r.images == [pics["a"], pics["b"]] for r in rollouts)
    assert list(failed) == [1] and "3 images in the prompt > generator.max_images_per_prompt=2" in failed[1]
    # an OpenRLHF file that drives its own engine calls is handed no images: refused group by group
    failed.clear()
    out = make_rollouts(grant, cfg, FakeEngine(tok), Sampling(max_tokens=4), client, "g", Counters(),
                        factory=ExecutorEpisodes(object(), "agent.py"))
    assert out == [] and "AgentExecutor's own execute" in failed[0]


# ------------------------------------------------------------------------------------------------
# the live engine


@pytest.fixture(scope="module")
def engine(vlm_dir):
    from actors.engines import VLLMEngine

    engine = VLLMEngine(str(vlm_dir), dtype="float32", seed=0, max_images_per_prompt=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def model(vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()


@pytest.mark.slow
def test_a_two_turn_episode_with_an_image_observation_is_what_the_learner_computes(engine, tok, processor, model,
                                                                                  vlm_dir, pics):
    from learner.modeling import completion_logprobs
    from learner.vision import Pixels, VisionRows, pad_token_id

    failed = {}
    client = SimpleNamespace(group_failed=lambda lease, group, why: failed.setdefault(group, why))
    cfg = GeneratorConfig(model=str(vlm_dir), max_turns=2, max_new_tokens=6, max_images_per_prompt=2).validate()
    groups = [PromptGroup(0, "<image>How many?", "3", images=[pics["a"]]), PromptGroup(1, "Look.", "")]
    grant = LeaseGrant(lease_id=6, groups=groups, n_samples=2, ttl_s=60.0, version=0)
    counts = Counters()
    rollouts = make_rollouts(grant, cfg, engine, Sampling(temperature=1.0, max_tokens=6, seed=4), client, "g", counts,
                             factory=lambda: PictureEnv([pics["wide"]]))
    assert not failed and len(rollouts) == 4, failed
    pad = engine.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    pixels = Pixels(vlm_dir)
    for r in rollouts:
        images = [pics["a"], pics["wide"]] if r.group_id == 0 else [pics["wide"]]
        assert r.images == images and r.env_reward == 1.0
        ids = r.prompt_ids.tolist() + r.completion_ids.tolist()
        # the prompt is the processor's expansion of the rendered prompt; the whole episode is the
        # processor's expansion of the conversation as the engine saw it (each image one pad), with all its images
        chat = [{"role": "user", "content": text_to_parts(groups[r.group_id].prompt)}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompt = processor(text=[text], images=[pil_image(pics["a"])] if r.group_id == 0 else None,
                           add_special_tokens=False)["input_ids"][0]
        assert r.prompt_ids.tolist() == list(prompt)
        text = tok.decode(collapsed(ids, pad), skip_special_tokens=False)
        whole = processor(text=[text], images=[pil_image(b) for b in images], add_special_tokens=False)["input_ids"][0]
        assert ids == list(whole)
        assert ids.count(pad) == 4 * (r.group_id == 0) + 8  # a 56x56 picture's 4 tokens, the 112x56's 8
        VisionRows.of(pixels, [images], torch.tensor([ids]))  # (raises ImageMismatch otherwise)
        # the observation, its picture's 8 placeholders included, is the environment's: mask 0
        mask = r.action_mask.astype(bool)
        first = int(np.argmin(mask))  # where the policy's first turn ends
        observation = expand(encode_observation(tok, OBSERVATION, None, images=1), pad, [8])
        assert r.completion_ids[first:first + len(observation)].tolist() == observation
        assert not mask[first:first + len(observation)].any() and mask[first + len(observation):].all()
        assert (r.behav_logprobs[~mask] == 0).all()
    # the learner's log-probs of the policy's tokens, with all the episode's pictures, are the engine's
    ours = completion_logprobs(model, [r.prompt_ids.tolist() for r in rollouts],
                               [r.completion_ids.tolist() for r in rollouts], temperature=1.0,
                               pad_id=pad_token_id(model.config), images=[r.images for r in rollouts], pixels=pixels)
    gap = max((lp - torch.from_numpy(r.behav_logprobs.copy()))[torch.from_numpy(r.action_mask.astype(bool))]
              .abs().max().item() for lp, r in zip(ours, rollouts))
    assert gap < TOL
    # the observation's picture matters: another of the same size gives the second turn other log-probs
    other = [[pics["a"], picture(112, 56, 9)], [picture(112, 56, 9)]]
    moved = completion_logprobs(model, [rollouts[0].prompt_ids.tolist(), rollouts[2].prompt_ids.tolist()],
                                [rollouts[0].completion_ids.tolist(), rollouts[2].completion_ids.tolist()],
                                pad_id=pad_token_id(model.config), images=other, pixels=pixels)
    for lp, r in zip(moved, (rollouts[0], rollouts[2])):
        second = torch.zeros(len(r.action_mask), dtype=torch.bool)
        second[int(np.argmin(r.action_mask)):] = True
        second &= torch.from_numpy(r.action_mask.astype(bool))
        assert (lp - torch.from_numpy(r.behav_logprobs.copy()))[second].abs().max().item() > 1e-3


@pytest.mark.slow
def test_an_episode_past_the_engines_image_limit_fails_naming_the_limit(engine, vlm_dir, pics):
    failed = {}
    client = SimpleNamespace(group_failed=lambda lease, group, why: failed.setdefault(group, why))
    cfg = GeneratorConfig(model=str(vlm_dir), max_turns=2, max_new_tokens=4, max_images_per_prompt=2).validate()
    groups = [PromptGroup(0, "<image>How many?", "3", images=[pics["a"]]), PromptGroup(1, "Look.", "")]
    grant = LeaseGrant(lease_id=7, groups=groups, n_samples=1, ttl_s=60.0, version=0)
    counts = Counters()
    # two pictures more: the image prompt's episode would hold 3, the text prompt's 2
    rollouts = make_rollouts(grant, cfg, engine, Sampling(temperature=1.0, max_tokens=4, seed=4), client, "g", counts,
                             factory=lambda: PictureEnv([pics["b"], pics["big"]], OBSERVATION + "<image>"))
    assert list(failed) == [0] and failed[0] == ("environment refused: 3 images in the episode (the prompt's and the "
                                                 "observations') > generator.max_images_per_prompt=2, the images one "
                                                 "engine request may hold")
    assert [r.group_id for r in rollouts] == [1] and rollouts[0].images == [pics["b"], pics["big"]]
    assert counts.env["refused"] == 1
