"""What OpenRLHF's offline flags need from the trainers: datasets mixed by probabilities, continued
pre-training (loss on every token), a chat template or an input template given on the command line,
the reward model's two losses, and packing for DPO and the reward model (the same losses and
gradients as padded batches)."""

from __future__ import annotations

import math

import pytest
import torch

from buffer.prompts import mix_order
from demo.tiny_model import build_tokenizer
from learner.offline.config import DPOConfig, RMConfig, SFTConfig
from learner.offline.datasets import Encoded, Pair, load_examples, load_splits
from learner.offline.loop import Data, load_tokenizer
from learner.offline.rm import pair_loss
from tests.helpers.offline import BOS, EOS, V, ids, write


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def sft_cfg(**kw) -> SFTConfig:
    return SFTConfig(**{"model_path": "m", "dataset": "d", "save_path": "s", **kw})


def test_datasets_mix_by_probabilities_as_openrlhf_interleaves_them(tmp_path, tok):
    a = write(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "response": "x"} for i in range(6)])
    b = write(tmp_path / "b.jsonl", [{"prompt": "b0", "response": "y"}, {"prompt": "b1", "response": "y"}])

    def prompts(cfg):
        train, _, stats = load_splits(tok, cfg, "sft")
        return ["".join(tok.decode([i]) for i in e.ids[1:3]) for e in train], stats

    # no probabilities: one dataset after the other
    got, stats = prompts(sft_cfg(dataset=f"{a},{b}", use_chat_template=False))
    assert got == [f"a{i}" for i in range(6)] + ["b0", "b1"] and [s.rows for s in stats] == [6, 2]
    # 0.5 / 0.5: draws until both were used whole, the short one starting over (all_exhausted)
    got, _ = prompts(sft_cfg(dataset=f"{a},{b}", dataset_probs=[0.5, 0.5], seed=3, use_chat_template=False))
    expect = [("a", "b")[d] + str(i) for d, i in mix_order([6, 2], [0.5, 0.5], 3)]
    assert got == expect and {f"a{i}" for i in range(6)} <= set(got) and got.count("b0") >= 1
    assert len(got) >= 6 + 1  # b was oversampled while a ran out
    # max_samples: of each dataset, then of the mix
    got, _ = prompts(sft_cfg(dataset=f"{a},{b}", dataset_probs=[0.9, 0.1], max_samples=3, use_chat_template=False))
    assert len(got) == 3 and set(got) <= {"a0", "a1", "a2", "b0", "b1"}
    with pytest.raises(ValueError, match=r"dataset_probs=\[1.0\] must hold one share > 0 for each of the 2"):
        sft_cfg(dataset=f"{a},{b}", dataset_probs=[1.0])


def test_pretrain_mode_trains_on_every_token_with_no_template(tmp_path, tok):
    path = write(tmp_path / "t.jsonl", [{"text": "the cat sat."}, {"text": ""}])
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # present, and not used
    try:
        cfg = sft_cfg(pretrain_mode=True, prompt_key="text", input_template="User: {}", on_bad_row="skip")
        [enc], stats = load_examples(path, tok, cfg, "sft")
    finally:
        tok.chat_template = None
    # <s> t h e ... . </s>: every token is a target (the first one is never predicted by the loss anyway)
    assert enc.ids == [BOS] + ids("the cat sat.") + [EOS]
    assert enc.target == [1] * len(enc.ids) and stats.bad == 1
    [enc], _ = load_examples(path, tok, cfg.replace(add_eos=False, max_len=4), "sft", limit=1)
    assert enc.ids == [BOS] + ids("the") and enc.target == [1] * 4


def test_input_template_frames_string_prompts_without_a_chat_template(tmp_path, tok):
    path = write(tmp_path / "p.jsonl", [{"prompt": "2+2", "response": "4", "chosen": "4", "rejected": "5"}])
    [enc], _ = load_examples(path, tok, sft_cfg(input_template="Q: {} A:", add_eos=False), "sft")
    assert enc.ids == [BOS] + ids("Q: 2+2 A:4") and enc.target == [0] * 10 + [1]
    [pair], _ = load_examples(path, tok, DPOConfig(model_path="m", dataset="d", save_path="s", add_eos=False,
                                                   input_template="Q: {} A:"), "pairs")
    assert pair.chosen.ids == [BOS] + ids("Q: 2+2 A:4") and pair.rejected.ids[-1] == V["5"]


def test_a_chat_template_given_on_the_command_line_replaces_the_tokenizers(tmp_path, tiny_model_dir):
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = load_tokenizer(str(tiny_model_dir), template)
    assert tok.chat_template == template
    path = write(tmp_path / "c.jsonl", [{"prompt": "hi", "response": "ok"}])
    [enc], _ = load_examples(path, tok, sft_cfg(chat_template=template), "sft")
    # "<user>hi" then the generation prompt "<assistant>", then the trained response "ok"
    assert enc.ids == ids("<user>hi<assistant>ok") and enc.target == [0] * 19 + [1, 1]
    # multiturn off: a conversation in the prompt column trains on its last assistant message only
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    path = write(tmp_path / "m.jsonl", [{"input": conv}])
    [enc], _ = load_examples(path, tok, sft_cfg(prompt_key="input", multiturn=False), "sft")
    assert enc.ids == ids("<user>a<assistant>b<user>c<assistant>d") and sum(enc.target) == 1
    [enc], _ = load_examples(path, tok, sft_cfg(prompt_key="input"), "sft")
    assert sum(enc.target) == 2  # multiturn (the default): both assistant turns


def test_reward_model_losses_match_hand_values():
    # pair 0: r_c 2, r_r 1, m 0.5: sigmoid -log sigmoid(2 - 1 - 0.5) = log(1 + e^-0.5) = 0.4740770
    #         logexpsigmoid log(1 + e^(1 - 2)) = log(1 + e^-1) = 0.3132617 (the margin is ignored)
    # pair 1: r_c 0, r_r 3, m 0.5: sigmoid log(1 + e^3.5) = 3.5297499; logexpsigmoid log(1 + e^3) = 3.0485874
    c, r, m = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 3.0]), torch.tensor([0.5, 0.5])
    assert pair_loss(c, r, m, "sigmoid").tolist() == pytest.approx([0.4740770, 3.5297499], abs=1e-6)
    assert pair_loss(c, r, m, "logexpsigmoid").tolist() == pytest.approx([0.3132617, 3.0485874], abs=1e-6)
    # a gap of 200: log(1 + e^200) = 200 to float precision, where exp alone would overflow to inf
    assert pair_loss(torch.tensor([0.0]), torch.tensor([200.0]), 0.0, "logexpsigmoid").item() == pytest.approx(200.0)
    assert math.isclose(pair_loss(torch.tensor([200.0]), torch.tensor([0.0]), 0.0, "logexpsigmoid").item(), 0.0,
                        abs_tol=1e-30)
    with pytest.raises(ValueError, match="unknown reward-model loss 'hinge'"):
        pair_loss(c, r, m, "hinge")


def pairs_data() -> Data:
    # different lengths on purpose: padding would show if the packed row let attention cross sequences
    rows = [([BOS] + ids("1+2="), ids("3\n"), ids("12\n")), ([BOS] + ids("10+25="), ids("35\n"), ids("9\n")),
            ([BOS] + ids("7="), ids("7\n"), ids("70\n"))]
    pairs = [Pair(Encoded(p + c, [0] * len(p) + [1] * len(c)), Encoded(p + r, [0] * len(p) + [1] * len(r)),
                  margin=0.25 * i) for i, (p, c, r) in enumerate(rows)]
    return Data(pairs, pairs, [])


def loss_and_grads(make, cfg, tok, model):
    trainer = make(cfg, tok, pairs_data(), 0, 1, torch.device("cpu"))
    model.zero_grad()
    loss, metrics = trainer.loss_fn(model, [0, 1, 2], 3.0)
    loss.backward()
    return loss.item(), metrics, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["dpo", "rm", "rm_lora"])
def test_packed_pairs_give_the_padded_losses_and_gradients(tiny_model_dir, tok, kind):
    from transformers import AutoModelForCausalLM

    from learner.lora import apply_lora
    from learner.offline import dpo, rm

    torch.manual_seed(0)
    if kind == "dpo":
        cfg = DPOConfig(model_path=str(tiny_model_dir), dataset="d", save_path="s", beta=0.5, nll_coef=0.3)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        with torch.no_grad():  # move the policy off the reference, so the DPO loss is not log 2 exactly
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        make = dpo.make_trainer
    else:
        cfg = RMConfig(model_path=str(tiny_model_dir), dataset="d", save_path="s", loss="sigmoid")
        model = rm.load_reward_model(str(tiny_model_dir), pad_token_id=0)
        if kind == "rm_lora":  # the score head read through peft's wrapper of it
            model = apply_lora(model, cfg.replace(lora_rank=4))
        make = rm.make_trainer
    padded = loss_and_grads(make, cfg, tok, model)
    packed = loss_and_grads(make, cfg.replace(packing=True), tok, model)
    assert packed[0] == pytest.approx(padded[0], abs=1e-5)
    for key in padded[1]:
        assert packed[1][key] == pytest.approx(padded[1][key], abs=1e-5), key
    assert len(packed[2]) == len(padded[2]) > 0
    for a, b in zip(packed[2], padded[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    if kind != "dpo":  # the margins (0, 0.25, 0.5) enter the sigmoid loss, not logexpsigmoid
        other = loss_and_grads(make, cfg.replace(packing=True, loss="logexpsigmoid"), tok, model)
        assert other[0] != pytest.approx(packed[0], abs=1e-4)
