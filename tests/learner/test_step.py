"""One learner step on the tiny model, in-process (a world of one), with rollouts built by hand.

Also home of the helpers the other learner tests use to fabricate rollouts (`make_group`, `ListSource`)
and to run a step's policy loss and backward on a plain module (`step_loss_and_grads`).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from learner.batching import mini_batches, to_train_batch
from learner.config import LearnerConfig
from tests.helpers.learner import ListSource, make_group, step_loss_and_grads


def test_to_train_batch_places_completion_tokens():
    scored = make_group(0, 2, [1.0, 0.0], version=3)
    tb = to_train_batch(scored, pad_id=0)
    for b, s in enumerate(scored):
        p, c = s.rollout.prompt_ids, s.rollout.completion_ids
        m = tb.completion_mask[b]
        # the completion tokens are predicted from positions len(p)-1 .. len(p)+len(c)-2
        assert m.nonzero().flatten().tolist() == list(range(len(p) - 1, len(p) + len(c) - 1))
        assert tb.input_ids[b, 1:][m].tolist() == c.tolist()
        assert np.allclose(tb.behav_logprobs[b][m].numpy(), s.rollout.behav_logprobs)
        assert (tb.versions[b][m] == 3).all() and (tb.versions[b][~m] == -1).all()
    assert tb.rewards.tolist() == [1.0, 0.0] and tb.ref_logprobs is None
    # a micro-batch of the shorter row is trimmed to that row's length
    short = int(tb.attention_mask.sum(-1).argmin())
    sub = tb.select(torch.tensor([short]))
    assert sub.input_ids.shape[1] == int(tb.attention_mask[short].sum())


def test_mini_batches_cover_every_row_once():
    mbs = mini_batches(10, num_mini_batches=2, grad_accum=3, seed=7)
    assert len(mbs) == 2 and all(len(mb) == 3 for mb in mbs)
    rows = sorted(torch.cat([i for mb in mbs for i in mb]).tolist())
    assert rows == list(range(10))
    assert [i.tolist() for mb in mbs for i in mb] == [i.tolist() for mb in mini_batches(10, 2, 3, 7) for i in mb]


def test_config_errors_quote_bad_values():
    with pytest.raises(ValueError) as e:  # refused when built, every bad value at once
        LearnerConfig(model_path="m", clip_eps_low=1.5, behav_low=3.0, behav_high=2.0, dual_clip_c=0.5).validate()
    msg = str(e.value)
    assert "clip_eps_low=1.5" in msg and "behav_low=3.0" in msg and "dual_clip_c=0.5" in msg


def test_one_step_with_positive_advantages_raises_logprobs(tiny_model_dir, tmp_path):
    from learner.metrics import read_metrics
    from learner.modeling import completion_logprobs, load_causal_lm
    from learner.trainer import train

    model = load_causal_lm(str(tiny_model_dir))
    # two groups of 4, every reward 1: with `reinforce` (A = reward) every advantage is +1
    scored = make_group(0, 4, [1.0] * 4, behav_model=model) + make_group(1, 4, [1.0] * 4, behav_model=model)
    prompts = [s.rollout.prompt_ids for s in scored]
    completions = [s.rollout.completion_ids for s in scored]
    before = torch.stack([lp.sum() for lp in completion_logprobs(model, prompts, completions)])

    cfg = LearnerConfig(model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"), total_steps=1,
                        advantage_estimator="reinforce", lr=1e-3, zero_stage=2, gradient_accumulation_steps=2,
                        tensorboard=True)
    cfg.validate()
    source = ListSource({0: scored})
    last = train(cfg, source=source)

    after_model = load_causal_lm(str(tmp_path / "run" / "checkpoints" / "step_1"))  # the HF checkpoint loads
    after = torch.stack([lp.sum() for lp in completion_logprobs(after_model, prompts, completions)])
    assert (after > before).all(), (before, after)
    # the behaviour log-probs were the model's own: w = 1 exactly, nothing clipped or masked
    assert last["policy/ess"] == pytest.approx(1.0) and last["policy/masked_frac"] == 0.0
    assert last["policy/behav_prox_kl"] == pytest.approx(0.0, abs=1e-6)
    assert last["advantages/mean"] == pytest.approx(1.0) and last["reward/mean"] == 1.0
    assert last["policy/clip_frac"] == 0.0
    assert source.versions == [0, 1]  # the buffer was told the version at the start and after the step
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0]
    for key in ("loss/policy", "loss/kl", "policy/ess", "optim/grad_norm", "optim/lr", "perf/tokens_per_s",
                "buffer/staleness_mean", "buffer/queued_groups", "time/wait_for_batch", "time/train_step"):
        assert key in rows[0], key
    assert rows[0]["optim/grad_norm"] > 0
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_1" / "trainer_state.json").read_text())
    assert state["step"] == 1


def test_ppo_critic_fits_the_returns(tiny_model_dir, tmp_path):
    """PPO with GAE: the critic (AutoModel backbone + value head) trains on the same rank; fed the
    same batch three times, its clipped value loss falls."""
    from learner.metrics import read_metrics
    from learner.trainer import train

    scored = make_group(0, 4, [1.0, 0.0, 0.5, 0.2]) + make_group(1, 4, [0.0, 0.3, 1.0, 1.0])
    cfg = LearnerConfig(model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"), total_steps=3,
                        advantage_estimator="gae", gae_lambda=0.95, critic_lr=3e-3, value_clip_eps=10.0,
                        lr=1e-4, zero_stage=2, tensorboard=False)
    cfg.validate()
    train(cfg, source=ListSource({0: scored, 1: scored, 2: scored}))
    rows = read_metrics(tmp_path / "run")
    values = [r["loss/value"] for r in rows]
    assert len(values) == 3 and values[2] < values[0], values
    assert all(r["advantages/std"] == pytest.approx(1.0, abs=1e-3) for r in rows)  # PPO whitens
    assert (tmp_path / "run" / "checkpoints" / "step_3" / "critic" / "state").is_dir()


@pytest.fixture
def published(monkeypatch) -> list:
    """A stand-in WeightSender; the list it returns gets (version, {name: tensor}) per publish and
    ("closed", {}) when the sender is closed."""
    import weight_sync.sender

    out = []

    class FakeSender:
        def __init__(self, host, port, timeout_s):
            self.address = (host, port)

        def publish(self, version, named_tensors, adapter=None):
            out.append((version, {name: t.clone() for name, t in named_tensors}))
            return {}

        def close(self):
            out.append(("closed", {}))

    monkeypatch.setattr(weight_sync.sender, "WeightSender", FakeSender)
    return out


def test_rank0_publishes_full_weights_every_sync(tiny_model_dir, tmp_path, published):
    """The weight-sync call site, with a stand-in sender: under ZeRO-3 every parameter is gathered
    whole and published in HF naming, as version 1 then 2; version 2 is what the checkpoint holds."""
    from safetensors.torch import load_file

    from learner.trainer import train

    scored = make_group(0, 4, [1.0, 0.0, 0.5, 0.2]) + make_group(1, 4, [0.0, 0.3, 1.0, 1.0])
    cfg = LearnerConfig(model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"), total_steps=2, lr=1e-3,
                        zero_stage=3, weight_sync_port=5999, sync_every=1, tensorboard=False)
    train(cfg, source=ListSource({0: scored, 1: scored}))

    assert [v for v, _ in published] == [1, 2, "closed"]
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors"))
    v2 = published[1][1]
    assert v2.keys() == initial.keys()  # HF names, nothing missing or extra
    for name, t in v2.items():
        assert t.shape == initial[name].shape and torch.equal(t, saved[name]), name
    assert any(not torch.equal(published[0][1][n], v2[n]) for n in v2)  # version 2 differs from 1


def test_a_failing_step_still_closes_what_the_loop_opened(tiny_model_dir, tmp_path, published):
    """kl_coef > 0 with rollouts that carry no reference log-probs fails step 0; the sender is closed
    anyway, the ledger and the metrics file are closed and hold nothing of the failed step."""
    from learner.metrics import read_metrics
    from learner.trainer import train

    scored = make_group(0, 4, [1.0, 0.0, 0.5, 0.2]) + make_group(1, 4, [0.0, 0.3, 1.0, 1.0])
    cfg = LearnerConfig(model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"), total_steps=2, kl_coef=0.1,
                        zero_stage=0, weight_sync_port=5999, tensorboard=False)
    source = ListSource({0: scored, 1: scored})
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprobs"):
        train(cfg, source=source)
    assert published == [("closed", {})]  # nothing published (fresh start, no step done), but closed
    assert read_metrics(tmp_path / "run") == [] and (tmp_path / "run" / "ledger.jsonl").read_text() == ""
    assert source.versions == [0]  # told the start, never a version that was not trained
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_learners_weight_sync_address_wins_over_the_section(tmp_path):
    """learner.weight_sync_host/port/timeout_s (which launchers may override) beat the `weight_sync:`
    section's; the section's own sender knobs (backend, bucket size) are kept."""
    from learner.trainer import weight_sender
    from weight_sync.config import WeightSyncConfig

    cfg = LearnerConfig(model_path="m", weight_sync_host="127.0.0.1", weight_sync_port=5999, weight_sync_timeout_s=7.0)
    section = WeightSyncConfig(host="10.0.0.1", port=1234, timeout_s=60.0, backend="disk", disk_dir=str(tmp_path),
                               bucket_mb=8)
    sender = weight_sender(cfg, section)
    try:
        assert (sender.cfg.host, sender.cfg.port, sender.timeout_s) == ("127.0.0.1", 5999, 7.0)
        assert sender.backend == "disk" and sender.bucket_bytes == 8 << 20
    finally:
        sender.close()


def test_overlong_filter_gives_truncated_responses_zero_gradient(tiny_model_dir):
    """DAPO's overlong filtering: with sample 1 of a group truncated (finish_reason `length`), rewriting
    that sample's completion leaves every gradient as it was; without the filter it does not. The
    truncated reward still counts in its group's advantages; a batch of truncated rows alone gets
    no gradient at all."""
    import copy

    from learner.advantages import grpo_advantages
    from learner.modeling import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    rewards = [1.0, 0.0, 0.5, 0.2]
    tb = to_train_batch(make_group(0, 4, rewards, truncated=(1,)))
    other = copy.copy(tb)  # the truncated completion rewritten: other tokens, other behaviour log-probs
    row = tb.completion_mask[1]
    other.input_ids = tb.input_ids.clone()
    other.input_ids[1, 1:][row] = (tb.input_ids[1, 1:][row] - 4 + 7) % 66 + 4
    other.behav_logprobs = tb.behav_logprobs.clone()
    other.behav_logprobs[1][row] -= 0.3

    def step_grads(batch, overlong_filter: bool):
        cfg = LearnerConfig(model_path="m", advantage_estimator="grpo", overlong_filter=overlong_filter)
        b, metrics, _, _, grads = step_loss_and_grads(model, cfg, batch)
        return list(grads.values()), b, metrics

    grads, b, metrics = step_grads(tb, True)
    assert metrics["overlong/truncated_frac"] == 0.25 and metrics["overlong/filtered_frac"] == 0.25
    assert not b.loss_mask[1].any() and b.loss_mask[0].any()
    expect = grpo_advantages(torch.tensor(rewards), torch.zeros(4, dtype=torch.long))  # all four rewards count
    assert torch.allclose(b.advantages[0][b.completion_mask[0]], expect[0].expand(int(b.completion_mask[0].sum())))
    rewritten, _, _ = step_grads(other, True)
    assert all(torch.equal(g, h) for g, h in zip(grads, rewritten))
    unfiltered, _, m_off = step_grads(tb, False)
    assert m_off["overlong/truncated_frac"] == 0.25 and m_off["overlong/filtered_frac"] == 0.0
    assert not all(torch.equal(g, h) for g, h in zip(unfiltered, step_grads(other, False)[0]))

    only_truncated = to_train_batch(make_group(1, 3, [1.0, 0.0, 0.5], truncated=(0, 1, 2)))
    assert all(float(g.abs().max()) == 0.0 for g in step_grads(only_truncated, True)[0])


def test_environment_tokens_get_exactly_zero_gradient(tiny_model_dir):
    """Two-turn episodes: the policy's tokens, then 2 an environment added (action_mask 0), then the
    policy's again. The loss's gradient with respect to the logits that predict each environment
    token is exactly zero, and nonzero at the policy's; the step's statistics count the policy's
    tokens only."""
    from learner.modeling import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    group = make_group(0, 4, [1.0, 0.0, 0.5, 0.2], completion_len=(6, 9), with_ref=True)
    for s in group:
        m = np.ones(len(s.rollout.completion_ids), dtype=np.uint8)
        m[2:4] = 0
        s.rollout.action_mask = m
    tb = to_train_batch(group)
    env = tb.completion_mask & ~tb.action_mask  # (B, T)
    assert int(env.sum()) == 8 and torch.equal(tb.action_mask, tb.completion_mask & ~env)
    captured = []

    def keep(module, inputs, output):
        if output.requires_grad:  # (not the no-grad forward of pi_old)
            output.retain_grad()
            captured.append(output)

    hook = model.lm_head.register_forward_hook(keep)
    try:
        for estimator in ("grpo", "rloo", "reinforce_pp"):
            captured.clear()
            cfg = LearnerConfig(model_path="m", advantage_estimator=estimator, kl_coef=0.1, kl_in="loss",
                                entropy_coef=0.01)
            b, metrics, _, _, _ = step_loss_and_grads(model, cfg, tb)
            logits = captured[-1]  # (B, L, V) of the loss's forward
            grad = logits.grad.abs().sum(-1)[:, : env.shape[1]]  # (B, T): the logits at t predict token t + 1
            assert float(grad[env].max()) == 0.0, estimator
            assert float(grad[tb.action_mask].min()) > 0.0, estimator
            assert not (b.loss_mask & env).any()
            assert metrics["perf/env_token_frac"] == pytest.approx(8 / int(tb.completion_mask.sum()))
    finally:
        hook.remove()


def test_a_packed_step_trains_policy_and_critic(tiny_model_dir, tmp_path):
    """learner.packing with PPO (the policy and the critic forward on packed rows) and overlong
    filtering: one step gives finite losses, moves the weights and logs the overlong metrics."""
    import math

    from safetensors.torch import load_file

    from learner.trainer import train

    scored = (make_group(0, 4, [1.0, 0.0, 0.5, 0.2], truncated=(3,), completion_len=(1, 41))
              + make_group(1, 4, [0.0, 0.3, 1.0, 1.0], completion_len=(1, 41)))
    cfg = LearnerConfig(model_path=str(tiny_model_dir), run_dir=str(tmp_path / "run"), total_steps=1, lr=1e-3,
                        advantage_estimator="gae", critic_lr=1e-3, packing=True, overlong_filter=True,
                        gradient_accumulation_steps=2, zero_stage=2, tensorboard=False)
    last = train(cfg, source=ListSource({0: scored}))
    assert all(math.isfinite(last[k]) for k in ("loss/policy", "loss/value", "optim/grad_norm"))
    assert last["optim/grad_norm"] > 0 and last["optim/critic_grad_norm"] > 0
    assert last["overlong/truncated_frac"] == 0.125 and last["overlong/filtered_frac"] == 0.125
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step_1" / "model.safetensors"))
    assert any(not torch.equal(initial[n], trained[n]) for n in initial)
