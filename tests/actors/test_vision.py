"""A vision-language policy (the tiny Qwen2-VL of demo.tiny_vlm) in the generator and the scorer.

The engine is given each prompt with one `<|image_pad|>` per image (`encode_prompt`) and the
images; it expands each pad to the image's tokens. The live tests check, on one vLLM engine
shared by the module, that the expansion is the model's processor's, that greedy completions are
transformers' own `generate` on the same checkpoint, that behaviour log-probs are the learner's
(`completion_logprobs` with the pixels), and that `make_rollouts` keeps the expanded ids and the
images while refusing, group by group, prompts whose markers and images disagree. One test starts
`AsyncVLLMEngine` too: its `submit` path (weight-sync mode `interrupt`) builds its requests apart.

The unit tests check the encoding rules, the length rule and `make_rollouts` with a fake engine.
Pictures are of three sizes: 56x56 (4 image tokens), 112x56 (8) and 84x84 (9).
"""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

from actors.config import GeneratorConfig
from actors.engines.base import Completion, Engine, Sampling
from actors.generator import Counters, before_placeholder, generate_batch, make_rollouts
from actors.prompts import IMAGE_PAD, IMAGE_TEXT, PromptRefused, encode_prompt, fit_prompt
from buffer.messages import ChatMessage, LeaseGrant, PromptGroup, decode_item, encode_item
from common.images import pil_image, text_to_parts

TOL = 1e-4  # vLLM's CPU build and transformers agree to ~1e-6 in fp32 (as tests/actors/test_engines.py)


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


def processor_inputs(processor, chat: list[dict], images: list[bytes]) -> dict:
    """What the model's processor gives for `chat` (contents with "<image>" markers) and its images:
    the template's text tokenized as the template's ids are (no bos of the tokenizer's own: the
    template writes its specials), each image's pad expanded, and the pixels."""
    parts = [{**m, "content": text_to_parts(m["content"])} if "<image>" in m["content"] else m for m in chat]
    text = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=[pil_image(b) for b in images], add_special_tokens=False,
                     return_tensors="pt")


def processor_ids(processor, chat: list[dict], images: list[bytes]) -> list[int]:
    return processor_inputs(processor, chat, images)["input_ids"][0].tolist()


# ------------------------------------------------------------------------------------------------
# encoding and the length rule (no engine)


def test_an_image_prompt_is_rendered_with_one_pad_per_image(tok, pics):
    ids = encode_prompt(tok, "<image>How many?", True, images=[pics["a"]])
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    assert ids == list(tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    assert ids.count(pad) == 1
    # chat messages: the markers of every message count, a message without one stays a string
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "<image> or <image>?")]
    ids = encode_prompt(tok, "ignored", True, messages, images=[pics["a"], pics["b"]])
    assert ids.count(pad) == 2
    assert tok.decode(ids) == (f"system: Be brief.\nuser: {IMAGE_TEXT} or {IMAGE_TEXT}?\nassistant: ")
    # without the template: each marker written as the image's tokens, the text as the loaders encode it
    plain = encode_prompt(tok, "Look <image>!", False, images=[pics["a"]])
    assert plain == tok.encode(f"Look {IMAGE_TEXT}!") and plain.count(pad) == 1


def test_a_prompt_whose_markers_and_images_disagree_is_refused_with_the_counts(tok, tiny_model_dir, pics):
    from transformers import AutoTokenizer

    with pytest.raises(PromptRefused, match=r"2 <image> marker\(s\) but 1 image"):
        encode_prompt(tok, "<image><image>Two?", True, images=[pics["a"]])
    with pytest.raises(PromptRefused, match=r"0 <image> marker\(s\) but 1 image"):
        encode_prompt(tok, "No marker", False, images=[pics["a"]])
    # a pad written in the text itself is a pad without pixels
    with pytest.raises(PromptRefused, match=r"2 <\|image_pad\|> for the prompt's 1 image"):
        encode_prompt(tok, f"<image> and {IMAGE_PAD}", True, images=[pics["a"]])
    # a text model's tokenizer has no image tokens, with or without its template
    text_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for templated in (True, False):
        with pytest.raises(PromptRefused, match="no .*tokens"):
            encode_prompt(text_tok, "<image>Hi", templated, images=[pics["a"]])


def test_a_text_prompt_is_encoded_as_before(tok):
    # images=None (a text group): "<image>" is plain text, no checks, as before images existed
    chat = [{"role": "user", "content": "<image>1+1="}]
    assert encode_prompt(tok, "<image>1+1=", True) == list(tok.apply_chat_template(chat, add_generation_prompt=True,
                                                                                   return_dict=False))
    assert encode_prompt(tok, "<image>1+1=", False) == tok.encode("<image>1+1=")


def test_an_image_prompt_is_never_truncated():
    cfg = GeneratorConfig(model="m", prompt_max_len=4, long_prompt="truncate", max_images_per_prompt=2)
    assert fit_prompt([1, 2, 3, 4, 5, 6], cfg) == ([3, 4, 5, 6], "")  # a text prompt keeps its tail
    ids, why = fit_prompt([1, 2, 3, 4, 5, 6], cfg, images=1)
    assert ids is None and "6 tokens with 1 image(s) > generator.prompt_max_len=4" in why and "never truncated" in why
    assert fit_prompt([1, 2, 3], cfg, images=2) == ([1, 2, 3], "")
    ids, why = fit_prompt([1, 2, 3], cfg, images=3)
    assert ids is None and why == "3 images in the prompt > generator.max_images_per_prompt=2"
    with pytest.raises(Exception, match="max_images_per_prompt"):
        GeneratorConfig(model="m", max_images_per_prompt=0)


def test_the_transformers_engine_refuses_images(tiny_model_dir, pics):
    from actors.engines.hf import TransformersEngine

    engine = TransformersEngine(str(tiny_model_dir))
    with pytest.raises(ValueError, match=r"text prompts only: prompt\(s\) \[1\]"):
        engine.generate([[1, 5], [1, 6]], 1, Sampling(max_tokens=2), images=[None, [pics["a"]]])
    assert len(engine.generate([[1, 5]], 1, Sampling(max_tokens=2), images=[None])[0]) == 1


# ------------------------------------------------------------------------------------------------
# make_rollouts with a fake engine


class FakeEngine(Engine):
    """Answers every prompt with the tokens 7 7 7; an image prompt's pads expanded to 4 each (as a
    56x56 picture's). Records what it was given. Its `generate` takes `images` only when `takes_images`."""

    def __init__(self, tokenizer, answers: dict[int, list[int]] | None = None):
        self.tokenizer, self.calls, self.answers = tokenizer, [], answers or {}  # prompt index -> its tokens
        self.pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    def generate(self, prompt_ids, n, sampling, **more):
        self.calls.append((prompt_ids, more, sampling.max_tokens))
        images = more.get("images") or [None] * len(prompt_ids)
        out = []
        for i, (p, imgs) in enumerate(zip(prompt_ids, images)):
            expanded = [t for i in p for t in ([i] * 4 if i == self.pad else [i])] if imgs else None
            tokens = self.answers.get(i, [7] * sampling.max_tokens)[:sampling.max_tokens]
            out.append([Completion(tokens, [-1.0] * len(tokens), "length", "", prompt_ids=expanded)
                        for _ in range(n)])
        return out

    def receive_weights(self, info):
        raise NotImplementedError


def failures():
    failed = {}
    client = SimpleNamespace(group_failed=lambda lease, group, why: failed.setdefault(group, why))
    return client, failed


def test_make_rollouts_keeps_the_expanded_ids_and_refuses_only_the_groups_that_disagree(tok, pics):
    engine = FakeEngine(tok)
    client, failed = failures()
    groups = [PromptGroup(0, "<image>How many?", "1", images=[pics["a"]]),
              PromptGroup(1, "1+1=", "2"),
              PromptGroup(2, "<image><image>Two?", "", images=[pics["a"]]),  # two markers, one image
              PromptGroup(3, "<image>" * 3, "", images=[pics["a"]] * 3),  # more than max_images_per_prompt
              PromptGroup(4, "<image>Broken?", "", images=[pics["a"][:40]])]  # a PNG cut short
    # max_len 36: the text prompt (22 ids) has room for 6 tokens; the image prompt (30 ids) would
    # have 6 too, but expanded (33) has 3
    cfg = GeneratorConfig(model="m", max_new_tokens=6, max_len=36, prompt_max_len=30, max_images_per_prompt=2)
    counts = Counters()
    rollouts = make_rollouts(LeaseGrant(lease_id=9, groups=groups, n_samples=2, ttl_s=60.0, version=0), cfg, engine,
                             Sampling(max_tokens=6), client, "gen-test", counts)
    assert sorted(failed) == [2, 3, 4] and counts.refused == 3
    assert "2 <image> marker(s) but 1 image" in failed[2] and "max_images_per_prompt=2" in failed[3]
    assert failed[4].startswith("image 0: not an image file PIL can read"), failed[4]
    [(prompt_ids, more, _)] = engine.calls
    assert more["images"] == [[pics["a"]], None]  # aligned with the sampled groups
    sent = encode_prompt(tok, "<image>How many?", True, images=[pics["a"]])
    assert prompt_ids == [sent, encode_prompt(tok, "1+1=", True)]
    by_group = {g: [r for r in rollouts if r.group_id == g] for g in (0, 1)}
    assert [len(v) for v in by_group.values()] == [2, 2]
    expanded = [t for i in sent for t in ([i] * 4 if i == engine.pad else [i])]
    assert (len(sent), len(expanded), len(prompt_ids[1])) == (30, 33, 22)
    for r in by_group[0]:
        assert r.prompt_ids.tolist() == expanded and r.images == [pics["a"]]
        assert len(r.completion_ids) == 3  # the budget counts the expanded prompt
    for r in by_group[1]:
        assert r.images is None and r.prompt_ids.tolist() == prompt_ids[1] and len(r.completion_ids) == 6
    # the images travel with the rollout (the wire codec)
    again = decode_item(encode_item(by_group[0][0]), "rollouts")
    assert bytes(again.images[0]) == pics["a"] and again.prompt_ids.tolist() == expanded


def test_a_text_lease_calls_the_engine_as_before_and_an_expansion_past_max_len_is_refused(tok, pics):
    class TextOnly(FakeEngine):
        def generate(self, prompt_ids, n, sampling):  # an engine that predates images
            return super().generate(prompt_ids, n, sampling)

    client, failed = failures()
    cfg = GeneratorConfig(model="m", max_new_tokens=4)
    out = make_rollouts(LeaseGrant(lease_id=1, groups=[PromptGroup(0, "1+1=", "2")], n_samples=1, ttl_s=60.0,
                                   version=0), cfg, TextOnly(tok), Sampling(max_tokens=4), client, "g", Counters())
    assert len(out) == 1 and not failed and out[0].images is None
    # a prompt within max_len before its images are expanded, past it after
    engine = FakeEngine(tok)
    sent = encode_prompt(tok, "<image>Hi", True, images=[pics["a"]])
    cfg = GeneratorConfig(model="m", max_new_tokens=4, max_len=len(sent) + 3, prompt_max_len=len(sent))
    grant = LeaseGrant(lease_id=2, groups=[PromptGroup(0, "<image>Hi", "", images=[pics["a"]])], n_samples=1,
                       ttl_s=60.0, version=0)
    out = make_rollouts(grant, cfg, engine, Sampling(max_tokens=4), client, "g", Counters())
    assert out == [] and "leaves no completion within generator.max_len" in failed[0]


def test_a_completion_is_ended_before_a_placeholder_it_sampled(tok, pics):
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    groups = [PromptGroup(0, "<image>Hi", "", images=[pics["a"]]), PromptGroup(1, "1+1=", "2")]
    grant = LeaseGrant(lease_id=4, groups=groups, n_samples=1, ttl_s=60.0, version=0)
    cfg = GeneratorConfig(model="m", max_new_tokens=4)
    answers = {0: [7, 8, pad, 9], 1: [pad, 7, 7, 7]}
    vision = FakeEngine(tok, answers)
    vision.placeholder_ids = (pad,)
    client, failed = failures()
    [r] = make_rollouts(grant, cfg, vision, Sampling(max_tokens=4), client, "g", Counters())
    assert r.group_id == 0 and r.completion_ids.tolist() == [7, 8] and r.finish_reason == "length"
    assert r.behav_logprobs.tolist() == [-1.0, -1.0]
    assert list(failed) == [1] and "began with an image placeholder" in failed[1]
    # a text policy's engine names no placeholders: its completions are kept whole
    client, failed = failures()
    out = make_rollouts(msgspec.structs.replace(grant, groups=groups[1:]), cfg, FakeEngine(tok, {0: [pad, 7, 7, 7]}),
                        Sampling(max_tokens=4), client, "g", Counters())
    assert not failed and out[0].completion_ids.tolist() == [pad, 7, 7, 7]


def test_generate_batch_hands_images_to_submit_in_interrupt_mode(tok, pics):
    from concurrent.futures import Future

    class Interrupting(FakeEngine):
        loads_mid_batch = True

        def submit(self, prompt_ids, n, sampling, **more):
            f = Future()
            f.set_result(self.generate(prompt_ids, n, sampling, **more))
            return f

    engine = Interrupting(tok)
    sync = SimpleNamespace(mode="interrupt", poll_s=0.01, poll_mid_batch=lambda e: None)
    out = generate_batch(engine, [[1, engine.pad]], 1, Sampling(max_tokens=1), sync, [[pics["a"]]])
    assert out[0][0].prompt_ids == [1] + [engine.pad] * 4 and engine.calls[0][1] == {"images": [[pics["a"]]]}


# ------------------------------------------------------------------------------------------------
# the live engine

PROMPTS = [("<image>How many?", ["a"]), ("Look: <image> then <image>. Same?", ["wide", "big"]),
           ("<image>Count.", ["b"]), ("Describe <image>", ["big"])]


def engine_inputs(tok, pics, prompts=PROMPTS):
    ids = [encode_prompt(tok, text, True, images=[pics[k] for k in keys]) for text, keys in prompts]
    return ids, [[pics[k] for k in keys] for _, keys in prompts]


@pytest.mark.slow
def test_the_engines_expansion_is_the_processors(engine, tok, processor, pics):
    ids, images = engine_inputs(tok, pics)
    out = engine.generate(ids, 1, Sampling(temperature=0.0, max_tokens=2), images=images)
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    for (text, keys), sent, imgs, group in zip(PROMPTS, ids, images, out):
        expected = processor_ids(processor, [{"role": "user", "content": text}], imgs)
        assert group[0].prompt_ids == expected
        assert sent.count(pad) == len(imgs) and len(expected) > len(sent)  # expanded by the engine, not before
    assert [c[0].prompt_ids.count(pad) for c in out] == [4, 8 + 9, 4, 9]
    assert engine.placeholder_ids == (pad, tok.convert_tokens_to_ids("<|video_pad|>"))
    # the limit reached vLLM (generator.max_images_per_prompt=2): a third image is refused
    three, _ = engine_inputs(tok, pics, [("<image><image><image>", ["a", "b", "a"])])
    with pytest.raises(ValueError):
        engine.generate(three, 1, Sampling(max_tokens=1), images=[[pics["a"], pics["b"], pics["a"]]])


@pytest.mark.slow
def test_greedy_completions_are_transformers_generate(engine, tok, processor, model, pics):
    ids, images = engine_inputs(tok, pics)
    out = engine.generate(ids, 1, Sampling(temperature=0.0, max_tokens=8), images=images)
    eos = model.generation_config.eos_token_id
    for (text, _), imgs, group in zip(PROMPTS, images, out):
        batch = processor_inputs(processor, [{"role": "user", "content": text}], imgs)
        with torch.no_grad():
            seq = model.generate(**batch, max_new_tokens=8, do_sample=False)[0, batch["input_ids"].shape[1]:].tolist()
        if eos in seq:
            seq = seq[:seq.index(eos) + 1]
        assert group[0].token_ids == seq, text
    # the pictures matter: the same text with another picture of the same size is answered with other odds
    other = engine.generate([ids[0]], 1, Sampling(temperature=0.0, max_tokens=1), images=[[pics["b"]]])[0][0]
    assert abs(other.logprobs[0] - out[0][0].logprobs[0]) > 1e-3


@pytest.mark.slow
def test_behaviour_logprobs_are_the_learners_with_the_pixels(engine, tok, model, vlm_dir, pics):
    from learner.modeling import completion_logprobs
    from learner.vision import Pixels, pad_token_id

    ids, images = engine_inputs(tok, pics)
    out = engine.generate(ids, 3, Sampling(temperature=1.0, max_tokens=10, seed=5), images=images)
    # as the generator keeps them: ended before a sampled placeholder (the random model samples them)
    ends = set(engine.placeholder_ids)
    comps = [before_placeholder(c, ends, tok) for g in out for c in g]
    rows = [imgs for imgs, g in zip(images, out) for _ in g]
    rows, comps = [r for r, c in zip(rows, comps) if c.token_ids], [c for c in comps if c.token_ids]
    assert len(comps) >= 8
    pixels = Pixels(vlm_dir)
    ours = completion_logprobs(model, [c.prompt_ids for c in comps], [c.token_ids for c in comps], temperature=1.0,
                               pad_id=pad_token_id(model.config), images=rows, pixels=pixels)
    gap = max((lp - torch.tensor(c.logprobs)).abs().max().item() for lp, c in zip(ours, comps))
    assert gap < TOL
    # another picture of the same size gives other log-probs: the engine's numbers are the pictures'
    other = completion_logprobs(model, [comps[0].prompt_ids], [comps[0].token_ids], pad_id=pad_token_id(model.config),
                                images=[[pics["b"]]], pixels=pixels)
    assert (other[0] - torch.tensor(comps[0].logprobs)).abs().max().item() > 1e-3


@pytest.mark.slow
def test_make_rollouts_samples_image_groups_and_the_reference_scores_them(engine, tok, processor, vlm_dir,
                                                                         tiny_model_dir, pics):
    from actors.config import ScorerConfig
    from actors.scorer import Scorer

    client, failed = failures()
    chat = [ChatMessage("system", "Be brief."), ChatMessage("user", "<image> and <image>?")]
    groups = [PromptGroup(0, "<image>How many?", "1", images=[pics["a"]]),
              PromptGroup(1, "Be brief.\n<image> and <image>?", "", messages=chat, images=[pics["wide"], pics["big"]]),
              PromptGroup(2, "<image><image>Two?", "", images=[pics["a"]]),  # refused: two markers, one image
              PromptGroup(3, "12+34=", "46")]
    cfg = GeneratorConfig(model=str(vlm_dir), max_new_tokens=6, max_images_per_prompt=2).validate()
    counts = Counters()
    rollouts = make_rollouts(LeaseGrant(lease_id=3, groups=groups, n_samples=2, ttl_s=60.0, version=0), cfg, engine,
                             Sampling(temperature=1.0, max_tokens=6, seed=1), client, "gen-test", counts)
    assert list(failed) == [2] and "2 <image> marker(s) but 1 image" in failed[2] and counts.refused == 1
    by_group = {g: [r for r in rollouts if r.group_id == g] for g in (0, 1, 3)}
    assert [len(v) for v in by_group.values()] == [2, 2, 2]
    expected = {0: processor_ids(processor, [{"role": "user", "content": "<image>How many?"}], [pics["a"]]),
                1: processor_ids(processor, [{"role": m.role, "content": m.content} for m in chat],
                                 [pics["wide"], pics["big"]])}
    for g in (0, 1):
        for r in by_group[g]:
            assert r.prompt_ids.tolist() == expected[g] and r.images == groups[g].images
    for r in by_group[3]:
        assert r.images is None and r.prompt_ids.tolist() == encode_prompt(tok, "12+34=", True)
    assert not set(np.concatenate([r.completion_ids for r in rollouts]).tolist()) & set(engine.placeholder_ids)
    # the reference (the same weights) scores every rollout with its pictures: its log-probs are mu
    scorer = Scorer(ScorerConfig(kinds=["reference"], reference=str(vlm_dir)).validate())
    try:
        scored = scorer.score(rollouts)
    finally:
        scorer.close()
    assert not any(s.failed for s in scored), [s.error for s in scored]
    gap = max(np.abs(s.ref_logprobs - s.rollout.behav_logprobs).max() for s in scored)
    assert gap < TOL
    # a text reference cannot score a rollout with pictures: those samples fail, the text ones do not
    text_ref = Scorer(ScorerConfig(kinds=["reference"], reference=str(tiny_model_dir)).validate())
    try:
        out = text_ref.score(by_group[0])
    finally:
        text_ref.close()
    assert all(s.failed and "is a text model" in s.error for s in out)


@pytest.mark.slow
def test_the_async_engines_submit_path_takes_images_as_the_offline_engine(engine, vlm_dir, tok, pics):
    """`AsyncVLLMEngine` builds its requests in `submit` (weight-sync mode `interrupt` calls it); the
    same greedy prompts give the offline engine's expanded ids and tokens."""
    from actors.engines import AsyncVLLMEngine

    ids, images = engine_inputs(tok, pics)
    greedy = Sampling(temperature=0.0, max_tokens=6)
    offline = engine.generate(ids, 1, greedy, images=images)
    async_engine = AsyncVLLMEngine(str(vlm_dir), dtype="float32", seed=0, max_images_per_prompt=2)
    try:
        sync = SimpleNamespace(mode="interrupt", poll_s=0.05, poll_mid_batch=lambda e: None)
        got = generate_batch(async_engine, ids, 1, greedy, sync, images)
    finally:
        async_engine.close()
    assert [(g[0].prompt_ids, g[0].token_ids) for g in got] == [(g[0].prompt_ids, g[0].token_ids) for g in offline]
    assert all(g[0].versions == [0] * len(g[0].token_ids) for g in got)
