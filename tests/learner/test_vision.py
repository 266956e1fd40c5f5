"""A vision-language policy in the learner: the forward with each row's pixels equals transformers'
own on the processor's inputs, rows whose placeholders and images disagree are refused, the
vision tower trains or stays frozen (and frozen, is left out of weight rounds), checkpoints are
written under the checkpoint's names, and LoRA adapts the language model only.

The learner runs in this process (a world of one, as `test_lora.py` does).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from buffer.messages import Rollout, ScoredRollout
from learner.config import LearnerConfig


@pytest.fixture(scope="module")
def pictures():
    from demo.vision import make_rows

    return [base64.b64decode(r["images"][0]) for r in make_rows(6, seed=3)]


def scored_rows(vlm_dir, pictures, answers=("2", "13", "0")) -> tuple[list[ScoredRollout], dict]:
    """One rollout per answer, its prompt as the engine expands it (the processor's ids), with one
    picture each (the second with two); and the processor's own batch of the same rows."""
    from transformers import AutoProcessor

    from common.images import pil_image, text_to_parts

    processor = AutoProcessor.from_pretrained(vlm_dir)
    out, texts, images = [], [], []
    for i, answer in enumerate(answers):
        imgs = pictures[i:i + 2] if i == 1 else pictures[i:i + 1]
        chat = [{"role": "user", "content": text_to_parts("<image>" * len(imgs) + "How many red squares?")}]
        prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = processor(text=[prompt], images=[pil_image(b) for b in imgs], add_special_tokens=False)["input_ids"][0]
        completion = processor.tokenizer(answer, add_special_tokens=False)["input_ids"]
        r = Rollout(group_id=i, sample_index=0, lease_id=0, prompt_ids=np.asarray(ids, np.int32),
                    completion_ids=np.asarray(completion, np.int32),
                    behav_logprobs=np.zeros(len(completion), np.float32),
                    versions=np.zeros(len(completion), np.int32), finish_reason="stop", images=list(imgs))
        out.append(ScoredRollout(rollout=r, reward=float(i)))
        texts.append(prompt + answer)
        images.append([pil_image(b) for b in imgs])
    processor.tokenizer.padding_side = "right"
    return out, processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False)


def test_the_learners_forward_with_pixels_is_transformers_own(vlm_dir, pictures):
    from transformers import AutoModelForImageTextToText

    from learner.batching import to_train_batch
    from learner.modeling import gather_logprobs, next_token_stats
    from learner.vision import Pixels

    scored, batch = scored_rows(vlm_dir, pictures)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    tb = to_train_batch(scored, 0, Pixels(vlm_dir))
    assert torch.equal(tb.input_ids, batch["input_ids"])  # (the engine's expansion is the processor's)
    with torch.no_grad():
        ours = next_token_stats(model, tb.input_ids, tb.attention_mask, vision=tb.vision)[0]  # (B, L-1)
        theirs = gather_logprobs(model(**batch).logits[:, :-1], batch["input_ids"][:, 1:])
        # a micro-batch of rows 1 and 2 takes exactly their images (row 1 has two)
        mb = tb.select(torch.tensor([1, 2]))
        part = next_token_stats(model, mb.input_ids, mb.attention_mask, vision=mb.vision)[0]
    mask = tb.completion_mask
    assert torch.allclose(ours[mask], theirs[mask], atol=1e-5)
    assert torch.allclose(part[mb.completion_mask], ours[1:][mask[1:]], atol=1e-5)
    # the images matter: without them the same ids give other log-probs
    with torch.no_grad():
        blind = next_token_stats(model, tb.input_ids, tb.attention_mask,
                                 vision=type(tb.vision)([p * 0 for p in tb.vision.pixels], tb.vision.grids,
                                                        tb.vision.image_token_id))[0]
    assert (blind[mask] - ours[mask]).abs().max() > 1e-3


def test_a_row_whose_placeholders_and_images_disagree_is_refused(vlm_dir, pictures):
    from learner.batching import to_train_batch
    from learner.vision import ImageMismatch, Pixels

    scored, _ = scored_rows(vlm_dir, pictures)
    scored[2].rollout.images = pictures[:2]  # two images for one placeholder run
    with pytest.raises(ImageMismatch, match=r"group 2 sample 0: 4 image placeholders .* need 8"):
        to_train_batch(scored, 0, Pixels(vlm_dir))
    with pytest.raises(ValueError, match="not a vision-language model"):
        to_train_batch(scored, 0, None)


def test_what_a_vision_policy_cannot_do_is_refused(vlm_dir, tiny_model_dir):
    from learner.vision import policy_pixels

    assert policy_pixels(str(tiny_model_dir), packing=True) is None  # (a text model: nothing to refuse)
    with pytest.raises(ValueError, match="learner.packing, learner.sequence_parallel"):
        policy_pixels(str(vlm_dir), packing=True, sequence_parallel=2)


def vlm_config(vlm_dir, run_dir, **kw) -> LearnerConfig:
    fields = dict(model_path=str(vlm_dir), run_dir=str(run_dir), lr=1e-2, dist_backend="gloo", tensorboard=False)
    return LearnerConfig(**{**fields, **kw})


@pytest.mark.parametrize("frozen", [True, False])
def test_the_vision_tower_trains_or_stays_frozen_and_a_frozen_one_is_never_sent(vlm_dir, pictures, tmp_path, frozen):
    from deepspeed.utils import safe_get_full_grad
    from transformers import AutoModelForImageTextToText

    from learner.batching import to_train_batch
    from learner.checkpoint import save_hf
    from learner.engine import build_policy_engine, iter_publish_params, process_group
    from learner.modeling import next_token_stats
    from learner.vision import Pixels, vision_parameters

    scored, _ = scored_rows(vlm_dir, pictures)
    tb = to_train_batch(scored, 0, Pixels(vlm_dir))
    cfg = vlm_config(vlm_dir, tmp_path, freeze_visual_encoder=frozen)
    with process_group(cfg):
        policy = build_policy_engine(cfg)
        before = {n: p.detach().clone() for n, p in policy.module.named_parameters()}
        lp = next_token_stats(policy, tb.input_ids, tb.attention_mask, vision=tb.vision)[0]
        policy.backward(-lp[tb.completion_mask].mean())
        grads = {n: None if g is None else g.abs().sum().item()
                 for n, g in ((n, safe_get_full_grad(p)) for n, p in vision_parameters(policy.module))}
        policy.step()
        after = dict(policy.module.named_parameters())
        sent = [n for n, _ in iter_publish_params(policy)]
        save_hf(policy, tmp_path / "hf", vlm_dir)
    vision = [n for n, _ in vision_parameters(policy.module)]
    moved = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert any(n.startswith("model.language_model.") for n in moved)
    if frozen:
        assert all(grads[n] is None for n in vision) and not moved & set(vision)
        assert sent and not any(n.startswith("visual.") for n in sent)
    else:
        assert all(g is not None for g in grads.values()) and sum(grads.values()) > 0, grads
        assert set(vision) <= moved
        assert sum(n.startswith("visual.") for n in sent) == len(vision)
    # a round and a checkpoint use the checkpoint's names, and the folder loads as the policy
    assert all(n.startswith(("visual.", "model.layers.", "model.embed_tokens.", "model.norm.", "lm_head."))
               for n in sent)
    saved = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    for n, p in saved.named_parameters():
        assert torch.equal(p, after[n].detach()), n
    assert (tmp_path / "hf" / "processor_config.json").is_file()


def test_lora_on_a_vision_policy_adapts_the_language_model_and_sends_merged_weights(vlm_dir, tmp_path):
    from learner.engine import build_policy_engine, iter_publish_params, process_group
    from learner.lora import adapter_spec, sends_merged

    cfg = vlm_config(vlm_dir, tmp_path, lora_rank=8, lora_alpha=16)
    with process_group(cfg):
        policy = build_policy_engine(cfg)
        wrapped = [n for n, m in policy.module.named_modules() if hasattr(m, "lora_A")]
        sent = [n for n, _ in iter_publish_params(policy)]
        merged, spec = sends_merged(policy), adapter_spec(policy)
    assert len(wrapped) == 14 and all(".language_model.layers." in n for n in wrapped)  # 7 linear x 2 blocks
    assert merged and spec is None
    # merged language-model weights; the vision tower (never trained under LoRA) stays out
    assert sent and not any(n.startswith("visual.") or "lora_" in n for n in sent)
