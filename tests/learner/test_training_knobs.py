"""OpenRLHF's training knobs in the learner: token-budget micro-batches, the MoE router aux loss, the
EMA of the policy and the critic's warm-up.

The pure pieces (the cut, the EMA update, the aux loss hook) are checked on their own, the
gradients on the tiny model as a plain module, and the loop's use of them by in-process learner
runs (a world of one; DeepSpeed, so run them under the heavy lock).
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from common.config import ConfigError
from learner.batching import TrainBatch, split_evenly, to_train_batch
from learner.config import LearnerConfig
from learner.packing import first_fit_decreasing
from learner.token_budget import cost, cut_by_tokens, over_budget, padded_bins, plan_micro_batches
from tests.helpers.learner import ListSource, make_group, run_two_ranks

# ------------------------------------------------------------------------------------------------
# the cut


@pytest.mark.parametrize("packing", [False, True])
def test_cut_keeps_every_micro_batch_within_the_budget(packing):
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randint(3, 40) for _ in range(rng.randint(1, 24))]
        budget = rng.randint(20, 120)
        rows = torch.arange(len(lengths))
        min_count = rng.randint(1, 3)
        micro, live = cut_by_tokens(lengths, rows, budget, packing, min_count, "cpu")
        assert sorted(torch.cat([m for m, ok in zip(micro, live) if ok]).tolist()) == list(range(len(lengths)))
        assert len(micro) >= min_count
        for m in micro:
            ls = [lengths[i] for i in m.tolist()]
            # padded: rows x longest; packed: the sum (one row); a lone row may be over
            assert len(ls) == 1 or cost(list(range(len(ls))), ls, packing) <= budget, (ls, budget)
        greedy = first_fit_decreasing(lengths, budget) if packing else padded_bins(lengths, budget)
        assert len(micro) == max(len(greedy), min_count)  # no more than the cut needs (or than asked for)


def test_padded_cut_by_hand():
    # budget 24: the 20 alone (over 24 with any other row: 2 x 20), 10 and 9 (2 x 10), 8, 8 and 3 (3 x 8)
    lengths = [8, 20, 3, 10, 9, 8]
    bins = [sorted(lengths[i] for i in b) for b in padded_bins(lengths, 24)]
    assert bins == [[20], [9, 10], [3, 8, 8]]
    # a row longer than the budget gets a micro-batch of its own, and is counted
    assert [sorted(lengths[i] for i in b) for b in padded_bins(lengths, 15)][0] == [20]
    assert over_budget(lengths, 15) == 1 and over_budget(lengths, 0) == 0


def test_fewer_rows_than_micro_batches_gives_fillers():
    lengths = [9] * 10
    lengths[4], lengths[9] = 5, 7  # the rank's mini-batch: rows 4 and 9
    micro, live = cut_by_tokens(lengths, torch.tensor([4, 9]), budget=100, packing=False, min_count=4, device="cpu")
    assert len(micro) == 4 and live.count(True) == 2
    assert sorted(torch.cat([m for m, ok in zip(micro, live) if ok]).tolist()) == [4, 9]
    assert all(m.tolist() == [4] for m, ok in zip(micro, live) if not ok)  # the shortest row again


# ------------------------------------------------------------------------------------------------
# the gradient of a mini-batch cut by tokens equals the count-cut one


def _batch(model) -> TrainBatch:
    scored = [s for g in range(4) for s in make_group(g, 4, [1.0, 0.0, 0.5, 0.2], seed=7, completion_len=(2, 30))]
    return to_train_batch(scored, pad_id=0)


def _grads(cfg, model, tb, plan, num_tokens, num_seqs, grad_accum):
    """The accumulated gradient of one mini-batch as DeepSpeed sums it (each loss / grad_accum)."""
    from learner.trainer import packed_rows, policy_micro_loss

    model.zero_grad()
    for j in range(len(plan.micro)):
        mb = plan.select(tb, j)
        loss, _ = policy_micro_loss(cfg, model, mb, packed_rows(cfg, mb, plan.capacity), num_tokens, num_seqs)
        (loss / grad_accum).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("packing", [False, True])
def test_token_budget_gradient_equals_count_cut(tiny_model_dir, packing):
    from learner.modeling import load_causal_lm
    from learner.token_budget import MicroBatches
    from learner.trainer import mini_batch_denominators, prepare_step

    model = load_causal_lm(str(tiny_model_dir)).train()
    cfg = LearnerConfig(model_path="m", advantage_estimator="grpo", packing=packing, gradient_accumulation_steps=2,
                        entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    tb = _batch(model)
    prepare_step(cfg, model, None, tb, step=0, world=1)
    lengths = tb.attention_mask.sum(-1).tolist()
    micro = split_evenly(torch.randperm(tb.size, generator=torch.Generator().manual_seed(1)), 2)
    num_tokens, num_seqs = mini_batch_denominators(tb.loss_mask, micro, world=1, grad_accum=2)

    by_count = plan_micro_batches(cfg, lengths, micro, "cpu")
    budget = 2 * max(lengths)
    by_tokens = plan_micro_batches(cfg.replace(max_tokens_per_micro_batch=budget), lengths, micro, "cpu")
    assert len(by_tokens.micro) > 2 and by_tokens.manual
    for j in range(len(by_tokens.micro)):  # what each forward sees stays within the budget
        mb = by_tokens.select(tb, j)
        seen = mb.packed_rows(by_tokens.capacity).num_slots if packing else mb.input_ids.numel()
        assert seen <= budget, (j, seen, budget)

    ref = _grads(cfg, model, tb, by_count, num_tokens, num_seqs, 2)
    got = _grads(cfg, model, tb, by_tokens, num_tokens, num_seqs, 2)
    # and with a filler micro-batch (what a rank with fewer rows than another's cut runs): nothing changes
    filler = MicroBatches(by_tokens.micro + [by_tokens.micro[0]], by_tokens.live + [False], by_tokens.capacity, True)
    padded = _grads(cfg, model, tb, filler, num_tokens, num_seqs, 2)
    assert ref.keys() == got.keys() == padded.keys()
    for n in ref:
        assert torch.allclose(got[n], ref[n], atol=1e-5, rtol=0), (n, (got[n] - ref[n]).abs().max())
        assert torch.allclose(padded[n], ref[n], atol=1e-5, rtol=0), n
    assert max(g.abs().max() for g in ref.values()) > 1e-3  # a gradient that says something


def test_metrics_of_a_token_cut_are_mini_batch_means():
    from learner.token_budget import MicroBatches

    plan = MicroBatches([torch.tensor([0]), torch.tensor([1, 2]), torch.tensor([0])], [True, True, False], 8, True)
    sums: dict[str, float] = {"loss/policy": 0.0, "policy/clip_frac": 0.0}
    for j, parts in enumerate([{"loss/policy": 0.3, "policy/clip_frac": 0.2},
                               {"loss/policy": 0.5, "policy/clip_frac": 0.4},
                               {"loss/policy": 9.0, "policy/clip_frac": 9.0}]):  # the filler's: left out
        plan.accumulate(sums, parts, j, grad_accum=1)
    # a loss share is summed (its normalisation is the mini-batch's); a fraction is averaged over the 2 live
    assert sums == pytest.approx({"loss/policy": 0.8, "policy/clip_frac": 0.3})
    assert plan.row_weight(0, 2) == pytest.approx(2 / 3) and plan.row_weight(2, 2) == 0.0


# ------------------------------------------------------------------------------------------------
# MoE router aux loss


def _tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=80, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0)
    return Qwen3MoeForCausalLM(cfg)  # ~7k parameters


def test_aux_loss_coef_adds_the_router_loss_to_the_gradient():
    from learner.moe import RouterAuxLoss
    from learner.trainer import policy_micro_loss, prepare_step

    model = _tiny_moe()
    cfg = LearnerConfig(model_path="m", advantage_estimator="grpo")
    tb = _batch(model)
    prepare_step(cfg, model, None, tb, step=0, world=1)

    def grads(coef):
        aux = RouterAuxLoss(model, coef) if coef else None
        model.zero_grad()
        loss, parts = policy_micro_loss(cfg, model, tb, None, None, None)
        if aux is not None:
            loss = aux.add(loss, parts, 1.0)
            aux.close()
        loss.backward()
        return loss.item(), parts, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    l0, _, g0 = grads(0.0)
    l1, parts, g1 = grads(0.5)
    router = [n for n in g0 if "mlp.gate." in n]
    assert router, sorted(g0)
    # the router's aux loss (about 2 for 4 experts, top-2: num_experts * sum f_i P_i) is added at 0.5
    assert parts["policy/router_aux_loss"] > 1.0
    assert l1 == pytest.approx(l0 + 0.5 * parts["policy/router_aux_loss"], rel=1e-5)
    assert any((g1[n] - g0[n]).abs().max() > 1e-4 for n in router)
    # no-grad forwards (pi_old) are not asked for router logits: the hook is gone after close, too
    with torch.no_grad():
        assert model(input_ids=tb.input_ids, attention_mask=tb.attention_mask).aux_loss is None


def test_aux_loss_coef_on_a_model_without_router_is_refused(tiny_model_dir):
    from learner.modeling import load_causal_lm
    from learner.moe import RouterAuxLoss

    with pytest.raises(ConfigError) as e:
        RouterAuxLoss(load_causal_lm(str(tiny_model_dir)), 0.01, str(tiny_model_dir))
    assert "learner.aux_loss_coef=0.01" in str(e.value) and "'llama'" in str(e.value)


def test_moe_policy_trains_with_its_router_loss(tmp_path):
    from learner.metrics import read_metrics
    from learner.trainer import train

    _tiny_moe().save_pretrained(tmp_path / "moe")
    run = tmp_path / "run"
    cfg = LearnerConfig(model_path=str(tmp_path / "moe"), run_dir=str(run), total_steps=1, advantage_estimator="grpo",
                        aux_loss_coef=0.01, gradient_accumulation_steps=2, tensorboard=False)
    train(cfg.validate(), source=ListSource(_steps(1)))
    row = read_metrics(run)[0]
    assert row["policy/router_aux_loss"] > 1.0  # num_experts * sum f_i P_i is about top_k = 2 when balanced
    assert (run / "checkpoints" / "step_1" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------------
# gradient checkpointing


def test_gradient_checkpointing_recomputes_the_layers_and_leaves_dropout_off(tiny_model_dir):
    """transformers checkpoints a layer only in training mode, and the learner's model is in eval
    mode (no dropout): the checkpointed layers alone are marked as training."""
    from learner.engine import load_trainable_lm

    ids = torch.tensor([[1, 5, 6, 7, 8]])
    grads, calls = {}, {}
    for on in (False, True):
        model = load_trainable_lm(str(tiny_model_dir), gradient_checkpointing=on)
        calls[on] = []
        model.model.layers[0].self_attn.register_forward_hook(lambda *a, n=calls[on]: n.append(1))
        model(ids).logits.square().mean().backward()
        grads[on] = {n: p.grad for n, p in model.named_parameters()}
        assert not model.training and not any(m.training for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert (len(calls[False]), len(calls[True])) == (1, 2), calls  # the layer's forward again in the backward
    for n, g in grads[False].items():
        assert torch.allclose(grads[True][n], g, atol=1e-6, rtol=0), n


# ------------------------------------------------------------------------------------------------
# config


def test_knob_config_errors_quote_bad_values():
    with pytest.raises(ValueError) as e:
        LearnerConfig(model_path="m", ema_beta=1.5, max_tokens_per_micro_batch=-1, aux_loss_coef=-1).validate()
    assert "ema_beta" in str(e.value) and "max_tokens_per_micro_batch" in str(e.value)
    with pytest.raises(ValueError, match="critic_warmup_steps=2"):
        LearnerConfig(model_path="m", critic_warmup_steps=2, advantage_estimator="grpo").validate()
    with pytest.raises(ValueError, match="ema_beta=0.99 with lora_rank=8"):
        LearnerConfig(model_path="m", ema_beta=0.99, lora_rank=8).validate()
    LearnerConfig(model_path="m", critic_warmup_steps=2, advantage_estimator="gae", ema_beta=0.99).validate()


# ------------------------------------------------------------------------------------------------
# EMA


def test_ema_update_by_hand():
    from learner.ema import PolicyEMA

    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    ema = PolicyEMA(lin, beta=0.75)
    for w in (3.0, 5.0):
        with torch.no_grad():
            lin.weight.fill_(w)
        ema.update(lin)
    # 0.75 * 1 + 0.25 * 3 = 1.5; 0.75 * 1.5 + 0.25 * 5 = 2.375
    assert ema.shadow["weight"].item() == pytest.approx(2.375)


# ------------------------------------------------------------------------------------------------
# in-process learner runs (DeepSpeed, a world of one)


def _steps(n: int, model=None) -> dict:
    return {s: make_group(2 * s, 4, [1.0, 0.0, 0.5, 0.2], seed=s, behav_model=model, completion_len=(2, 20))
            + make_group(2 * s + 1, 4, [0.0, 0.3, 1.0, 1.0], seed=s, behav_model=model, completion_len=(2, 20))
            for s in range(n)}


def _weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _trained(ckpt) -> dict[str, torch.Tensor]:
    """The trained (fp32 master) weights of the DeepSpeed state in checkpoint `ckpt`, any ZeRO stage."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt / "deepspeed"), tag="state")


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ema_is_what_checkpoints_hold_and_survives_resume(tiny_model_dir, tmp_path, zero_stage):
    from learner.trainer import train

    steps = _steps(2)
    base = dict(model_path=str(tiny_model_dir), total_steps=2, save_every=1, advantage_estimator="grpo", lr=1e-2,
                ema_beta=0.5, zero_stage=zero_stage, tensorboard=False)
    w0 = _weights(tiny_model_dir)
    run = tmp_path / "run"
    train(LearnerConfig(run_dir=str(run), **base).validate(), source=ListSource(steps))
    ema1, ema2 = _weights(run / "checkpoints" / "step_1"), _weights(run / "checkpoints" / "step_2")
    assert ema1.keys() == w0.keys()
    # one update a step: ema_1 = (w0 + w1) / 2, ema_2 = (ema_1 + w2) / 2 (under ZeRO-3, partitions gathered)
    w1, w2 = _trained(run / "checkpoints" / "step_1"), _trained(run / "checkpoints" / "step_2")
    for n in w0:
        assert torch.allclose(ema1[n], 0.5 * (w0[n] + w1[n]), atol=1e-6), n
        assert torch.allclose(ema2[n], 0.5 * (ema1[n] + w2[n]), atol=1e-6), n
    assert max((w2[n] - ema2[n]).abs().max() for n in w0) > 1e-3  # the trained weights are elsewhere
    # resumed from step_1 (its EMA state on disk), step 2 gives the same EMA as the run that went on
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_2")
    (resumed / "checkpoints" / "latest").write_text("step_1\n")
    train(LearnerConfig(run_dir=str(resumed), resume=True, **base).validate(), source=ListSource(steps))
    again = _weights(resumed / "checkpoints" / "step_2")
    for n in w0:
        assert torch.allclose(again[n], ema2[n], atol=1e-6), n


def test_a_checkpoint_is_complete_only_with_its_ema(tiny_model_dir, tmp_path, monkeypatch):
    """The EMA is written before the checkpoint is marked complete: a learner stopped while writing it
    leaves no folder a resume picks (it would have resumed without the EMA it was saved with)."""
    from learner.checkpoint import latest_checkpoint
    from learner.ema import PolicyEMA
    from learner.trainer import train

    def killed(self, out, engine):
        (out / "ema").mkdir(exist_ok=True)
        raise KeyboardInterrupt("killed while writing the EMA")

    monkeypatch.setattr(PolicyEMA, "save", killed)
    run = tmp_path / "run"
    cfg = LearnerConfig(model_path=str(tiny_model_dir), run_dir=str(run), total_steps=1, save_every=1,
                        advantage_estimator="grpo", ema_beta=0.5, tensorboard=False).validate()
    with pytest.raises(KeyboardInterrupt):
        train(cfg, source=ListSource(_steps(1)))
    assert not (run / "checkpoints" / "step_1").exists()  # the half-written folder is removed, never marked complete
    assert latest_checkpoint(run) is None


def test_critic_warmup_keeps_the_policy_for_its_steps(tiny_model_dir, tmp_path):
    from learner.metrics import read_metrics
    from learner.trainer import train

    run = tmp_path / "run"
    cfg = LearnerConfig(model_path=str(tiny_model_dir), run_dir=str(run), total_steps=2, save_every=1,
                        advantage_estimator="gae", critic_warmup_steps=1, lr=1e-2, critic_lr=1e-2,
                        tensorboard=False).validate()
    train(cfg, source=ListSource(_steps(2)))
    w0 = _weights(tiny_model_dir)
    w1, w2 = _weights(run / "checkpoints" / "step_1"), _weights(run / "checkpoints" / "step_2")
    assert all(torch.equal(w1[n], w0[n]) for n in w0)  # step 0: the critic only
    assert any(not torch.equal(w2[n], w1[n]) for n in w0)  # step 1: the policy too
    rows = read_metrics(run)
    assert [r["policy/frozen"] for r in rows] == [1.0, 0.0]
    assert "loss/policy" not in rows[0] and "loss/policy" in rows[1]
    assert all(r["loss/value"] > 0 for r in rows)  # the critic trained in both
    # and the critic moved during the warm-up: step 1's old values are no longer the zero head's
    c0 = torch.load(run / "checkpoints" / "step_1" / "critic" / "state" / "mp_rank_00_model_states.pt",
                    map_location="cpu", weights_only=False)["module"]
    assert c0["value_head.weight"].abs().max() > 0


def test_token_budget_run_steps_once_per_mini_batch(tiny_model_dir, tmp_path):
    from learner.metrics import read_metrics
    from learner.trainer import train

    steps = _steps(1)
    base = dict(model_path=str(tiny_model_dir), total_steps=1, advantage_estimator="grpo", lr=1e-3, adam_eps=1e-3,
                warmup_steps=9, num_mini_batches=2, gradient_accumulation_steps=1, tensorboard=False)
    train(LearnerConfig(run_dir=str(tmp_path / "count"), **base).validate(), source=ListSource(steps))
    train(LearnerConfig(run_dir=str(tmp_path / "tokens"), max_tokens_per_micro_batch=30, **base).validate(),
          source=ListSource(steps))
    count, tokens = read_metrics(tmp_path / "count")[0], read_metrics(tmp_path / "tokens")[0]
    assert count["perf/micro_batches"] == 1.0 and tokens["perf/micro_batches"] > 2.0
    # two optimizer steps either way: warm-up multiplier (2 + 1) / (9 + 1) = 0.3
    assert tokens["optim/lr"] == pytest.approx(3e-4) and count["optim/lr"] == pytest.approx(3e-4)
    # the same gradient: the same norm, loss and update
    assert tokens["optim/grad_norm"] == pytest.approx(count["optim/grad_norm"], rel=1e-5)
    assert tokens["loss/policy"] == pytest.approx(count["loss/policy"], rel=1e-5, abs=1e-7)
    a, b = (_weights(tmp_path / name / "checkpoints" / "step_1") for name in ("count", "tokens"))
    assert max((a[n] - b[n]).abs().max() for n in a) < 1e-5


TWO_RANKS = r'''
import sys
from learner.config import LearnerConfig
from learner.trainer import train
from tests.helpers.learner import ListSource, make_group

model_dir, out = sys.argv[-2:]  # (the launcher puts --local_rank=N first)
# 3 groups: rank 0 gets groups 0 and 2 (8 rows), rank 1 group 1 (4 rows), so that cut by 20 tokens
# rank 0 needs more micro-batches than rank 1 has rows (rank 1 runs fillers)
steps = {0: [s for g, r in enumerate([[1.0, 0.0, 0.5, 0.2], [0.0, 0.3, 1.0, 1.0], [1.0, 1.0, 0.0, 0.4]])
             for s in make_group(g, 4, r, seed=5, completion_len=(8, 20))]}
for name, budget in (("count", 0), ("tokens", 20)):
    cfg = LearnerConfig(model_path=model_dir, run_dir=f"{out}/{name}", total_steps=1, advantage_estimator="grpo",
                        lr=1e-3, zero_stage=3, ema_beta=0.5, max_tokens_per_micro_batch=budget, tensorboard=False,
                        adam_eps=1e-3)  # (so that Adam's first step does not blow rounding in tiny gradients up to lr)
    train(cfg.validate(), source=ListSource(steps))
'''


def test_two_ranks_zero3_ema_and_token_budget(tiny_model_dir, tmp_path):
    """ZeRO-3 over two ranks: the EMA's partitions gather into the HF folder, and a token cut that
    gives the ranks different needs (fillers on one) trains the same weights as the count cut."""
    from learner.metrics import read_metrics

    run_two_ranks(TWO_RANKS, tmp_path, str(tiny_model_dir), str(tmp_path), timeout_s=240)
    count, tokens = read_metrics(tmp_path / "count")[0], read_metrics(tmp_path / "tokens")[0]
    assert count["perf/micro_batches"] == 1.0 and tokens["perf/micro_batches"] >= 6  # rank 0's longest rows alone
    assert tokens["perf/over_budget_samples"] > 0 and count["perf/over_budget_samples"] == 0
    assert tokens["optim/grad_norm"] == pytest.approx(count["optim/grad_norm"], rel=1e-5)
    w0 = _weights(tiny_model_dir)
    trained = {name: _trained(tmp_path / name / "checkpoints" / "step_1") for name in ("count", "tokens")}
    for n in w0:
        assert torch.allclose(trained["tokens"][n], trained["count"][n], atol=1e-5), n
    ema = _weights(tmp_path / "tokens" / "checkpoints" / "step_1")
    for n in w0:  # one update: (w0 + w1) / 2, gathered from both ranks' partitions
        assert torch.allclose(ema[n], 0.5 * (w0[n] + trained["tokens"][n]), atol=1e-6), n
    assert max((trained["tokens"][n] - w0[n]).abs().max() for n in w0) > 1e-4
