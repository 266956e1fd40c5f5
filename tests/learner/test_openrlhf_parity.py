"""The learner's estimators and loss knobs against OpenRLHF 0.11.2's formulas, written out here
(`orl_*`, on OpenRLHF's frame: one row per completion, its tokens first, right padding) from
experience_maker.py, models/utils.py (compute_reward, compute_approx_kl), kl_controller.py,
length_penalty.py and models/loss.py (PolicyLoss). The learner runs on its own frame (prompt
positions before the completion, rows in any order, group ids): every result is equal within 1e-6."""

import json
import math

import pytest
import torch

from learner.advantages import ESTIMATORS, advantages_and_returns, stop_properly_penalty
from learner.config import ADVANTAGE_ESTIMATORS, LearnerConfig
from learner.kl_control import KLController, kl_seq_mean
from learner.losses import behaviour_correction, gspo_loss, kl_penalty, policy_loss

TOL = 1e-6
N = 4  # samples per prompt
PROMPT = 2  # prompt positions in front of each completion on the learner's frame


# ---- OpenRLHF's formulas ------------------------------------------------------------------------


def orl_baseline(est, rewards):
    """compute_advantages_and_returns' reward shaping; rewards (P * N,) in prompt order."""
    r = rewards.reshape(-1, N)
    if est == "rloo":
        r = r - (r.sum(-1, keepdim=True) - r) / (N - 1)
    elif est in ("reinforce_baseline", "dr_grpo"):
        r = r - r.mean(-1, keepdim=True)
    elif est == "group_norm":
        r = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)
    elif est == "flash_reinforce":
        r = r - r.mean()
    return r.reshape(-1)


def orl_compute_reward(r, kl_coef, kl, action_mask, clip_range):
    kl_coef = max(kl_coef, 0.0)
    r = r.clamp(min=clip_range[0], max=clip_range[1])
    eos = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last = torch.zeros_like(kl).scatter_(1, eos, r.unsqueeze(1).to(kl.dtype))
    return last - kl_coef * kl


def orl_gae(values, rewards, action_mask, gamma, lambd):
    values, rewards = action_mask * values, action_mask * rewards
    lastgaelam, out = 0, []
    T = rewards.size(1)
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


def orl_cumulative_returns(rewards, action_mask, gamma):
    rewards = action_mask * rewards
    returns, running = torch.zeros_like(rewards), torch.zeros(rewards.size(0), dtype=rewards.dtype)
    for t in reversed(range(rewards.size(1))):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns


def orl_advantages(est, rewards, kl, action_mask, values=None, kl_coef=0.0, gamma=1.0, lambd=1.0,
                   clip_range=(-10.0, 10.0), no_std_norm=False):
    shaped = compute = orl_compute_reward(orl_baseline(est, rewards), kl_coef, kl, action_mask, clip_range)
    if est == "gae":
        adv, _ = orl_gae(values, compute, action_mask, gamma, lambd)
    else:
        adv = orl_cumulative_returns(shaped, action_mask, gamma if est == "reinforce" else 1.0)
    if est in ("gae", "reinforce", "reinforce_baseline"):
        m = action_mask.to(adv.dtype)
        mean = (adv * m).sum() / m.sum()
        rstd = 1
        if not no_std_norm:
            var = ((adv - mean).pow(2) * m).sum() / m.sum()
            rstd = var.clamp(min=1e-8).rsqrt()
        adv = (adv - mean) * rstd
    return adv * action_mask


def orl_approx_kl(log_probs, log_probs_base, estimator, log_probs_old=None, unbiased_gradient=False):
    log_ratio = log_probs.float() - log_probs_base.float()
    if estimator == "k1":
        value = log_ratio
    elif estimator == "k2":
        value = log_ratio ** 2 / 2.0
    else:
        lr = log_ratio.clamp(min=-10)
        value = (-lr).exp() - 1 + lr
    value = value.clamp(min=-10, max=10)
    if not unbiased_gradient:
        return value
    w = 1.0 if log_probs_old is None else (log_probs.float() - log_probs_old.float()).exp().clamp(max=10.0).detach()
    surrogate = w * (log_ratio ** 2 / 2.0)
    return value.detach() + surrogate - surrogate.detach()


def orl_masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim)


def orl_policy_loss(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs=None, clip_low=0.2,
                    clip_high=0.2, dual_clip=None, loss_type="ppo", token_level=True, level="off", mode="mask",
                    gating="ratio", threshold=(0.5, 5.0)):
    """PolicyLoss.forward with no global normalisers (batch_num_tokens, global_batch_size None)."""
    raw = log_probs - old_log_probs
    if loss_type == "ppo":
        ratio = raw.clamp(min=-20.0, max=20.0).exp()
    else:
        token_level = False
        lr = log_probs - rollout_log_probs if level != "off" else raw
        ratio = (lr * action_mask).sum(-1) / action_mask.sum(-1).clamp(min=1)
        ratio = ratio.exp().unsqueeze(-1) * action_mask
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    if dual_clip is None:
        loss = -torch.min(surr1, surr2)
    else:
        clip1 = torch.min(surr1, surr2)
        loss = -torch.where(advantages < 0, torch.max(clip1, dual_clip * advantages), clip1)
    if level != "off" and loss_type == "ppo":
        low, high = threshold
        is_log_ratio = (old_log_probs - rollout_log_probs).detach()
        token_is = is_log_ratio.exp()
        if gating == "ratio":
            stat = orl_masked_mean(is_log_ratio, action_mask, -1).unsqueeze(-1) if level == "seq" else is_log_ratio
            stat = stat.exp()
        else:
            p = rollout_log_probs.exp().clamp(1e-6, 1 - 1e-6)
            q = old_log_probs.exp().clamp(1e-6, 1 - 1e-6)
            stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log() if gating == "binary_kl" else (p - q).abs()
            if level == "seq":
                stat = orl_masked_mean(stat, action_mask, -1).unsqueeze(-1)
        if mode == "clip":
            coef = stat.clamp(min=low, max=high)
        else:
            coef = torch.where((stat >= low) & (stat <= high), token_is, 0.0)
        loss = coef * loss
    if token_level:
        return orl_masked_mean(loss, action_mask)
    counts = action_mask.sum(-1)
    seq = (loss * action_mask).sum(-1) / (counts + 1e-8)
    return orl_masked_mean(seq, (counts > 0).to(seq.dtype))


# ---- the batch ----------------------------------------------------------------------------------


def batch(seed=0, prompts=3):
    """P prompts x N completions of lengths 1..6, in prompt order on OpenRLHF's frame (B, T)."""
    g = torch.Generator().manual_seed(seed)
    B, T = prompts * N, 6
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)  # (B, T)
    return {
        "rewards": torch.randint(0, 3, (B,), generator=g).double() + torch.rand(B, generator=g, dtype=torch.float64),
        "mask": mask,
        "kl": torch.rand(B, T, generator=g, dtype=torch.float64) * 0.3 * mask,
        "values": torch.randn(B, T, generator=g, dtype=torch.float64) * mask,
    }


def to_learner_frame(x, order):
    """OpenRLHF's (B, T) rows -> the learner's: rows in `order`, PROMPT positions in front, one padding after."""
    x = x[order]
    pad = torch.zeros(x.shape[0], PROMPT, dtype=x.dtype)
    return torch.cat([pad, x, torch.zeros(x.shape[0], 1, dtype=x.dtype)], dim=1)


def from_learner_frame(x, order):
    out = torch.empty_like(x[:, PROMPT:-1])
    out[order] = x[:, PROMPT:-1]
    return out


def learner_advantages(est, b, order, sum_fn=None, **kw):
    mask = to_learner_frame(b["mask"], order)
    group_ids = (torch.arange(len(order)) // N)[order] * 7 + 3  # any ids, one per prompt
    adv, _ = advantages_and_returns(est, b["rewards"][order], group_ids, mask, to_learner_frame(b["kl"], order),
                                    values=to_learner_frame(b["values"], order), sum_fn=sum_fn, **kw)
    assert (adv[~mask] == 0).all()
    return from_learner_frame(adv, order)


def assert_close(x, y):
    torch.testing.assert_close(x, y, atol=TOL, rtol=0)


ORDER = torch.randperm(12, generator=torch.Generator().manual_seed(5))
# OpenRLHF name -> (learner estimator, keyword arguments that make it OpenRLHF's)
MAPPING = {
    "group_norm": ("group_norm", {"eps": 1e-9}),
    "dr_grpo": ("dr_grpo", {}),
    "rloo": ("rloo", {}),
    "reinforce_baseline": ("reinforce_baseline", {}),
    "flash_reinforce": ("flash_reinforce", {}),
    "reinforce": ("reinforce_pp", {}),
    "gae": ("gae", {}),
}


# ---- estimators ---------------------------------------------------------------------------------


@pytest.mark.parametrize("orl_name", sorted(MAPPING))
@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_estimators_match_openrlhf(orl_name, kl_coef):
    """Every estimator, with and without the KL folded into the reward, and a discount where
    OpenRLHF keeps one (reinforce, gae); OpenRLHF's default reward clip [-10, 10]."""
    b = batch()
    est, kw = MAPPING[orl_name]
    expected = orl_advantages(orl_name, b["rewards"], b["kl"], b["mask"], b["values"], kl_coef, gamma=0.9,
                              lambd=0.8)
    got = learner_advantages(est, b, ORDER, kl_coef=kl_coef, gamma=0.9, lam=0.8, clip_range=(-10.0, 10.0), **kw)
    assert_close(got, expected * b["mask"])


@pytest.mark.parametrize("orl_name", ["reinforce_baseline", "reinforce", "gae"])
def test_no_std_norm_whitens_by_the_mean_only(orl_name):
    """--algo.advantage.no_std_norm touches the three whitened estimators: mean removed, no std."""
    b = batch(1)
    est, _ = MAPPING[orl_name]
    expected = orl_advantages(orl_name, b["rewards"], b["kl"], b["mask"], b["values"], 0.1, no_std_norm=True)
    got = learner_advantages(est, b, ORDER, kl_coef=0.1, std_norm=False)
    assert_close(got, expected)
    m = b["mask"]
    assert abs(float((got * m).sum() / m.sum())) < TOL  # zero mean, and not unit variance
    assert abs(float((got.square() * m).sum() / m.sum()) - 1.0) > 1e-3


@pytest.mark.parametrize("orl_name", ["group_norm", "dr_grpo", "rloo", "flash_reinforce"])
def test_no_std_norm_leaves_the_others_alone(orl_name):
    b = batch(2)
    est, kw = MAPPING[orl_name]
    on = learner_advantages(est, b, ORDER, **kw)
    assert torch.equal(on, learner_advantages(est, b, ORDER, std_norm=False, **kw))


def test_reinforce_baseline_is_not_rloo():
    """OpenRLHF's reinforce_baseline: r - group mean, then whitened over the batch's tokens. By hand:
    one prompt, rewards [1, 0, 0, 1] over lengths [1, 1, 2, 2]: r - mean = [0.5, -0.5, -0.5, 0.5];
    tokens [0.5], [-0.5], [-0.5, -0.5], [0.5, 0.5]: mean 0, var 0.25 -> [1], [-1], [-1, -1], [1, 1]."""
    mask = torch.tensor([[1, 0], [1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    adv, _ = advantages_and_returns("reinforce_baseline", r, torch.zeros(4, dtype=torch.long), mask)
    assert_close(adv, torch.tensor([[1.0, 0.0], [-1.0, 0.0], [-1.0, -1.0], [1.0, 1.0]], dtype=torch.float64))
    rloo, _ = advantages_and_returns("rloo", r, torch.zeros(4, dtype=torch.long), mask)
    assert rloo[0, 0].item() == pytest.approx(1 - 1 / 3)  # 1 - mean(0, 0, 1): a different estimator


def test_flash_reinforce_mean_spans_all_ranks():
    """Two ranks holding halves of the batch, summing their statistics, get the whole batch's mean."""
    b = batch(3)
    expected = orl_advantages("flash_reinforce", b["rewards"], b["kl"], b["mask"])
    r = b["rewards"]
    halves = [torch.arange(0, 8), torch.arange(8, 12)]
    got = []
    for i, idx in enumerate(halves):
        other = r[halves[1 - i]]
        extra = torch.stack([other.sum(), torch.tensor(float(other.numel()), dtype=torch.float64)])
        adv, _ = advantages_and_returns("flash_reinforce", r[idx], idx // N, b["mask"][idx],
                                        sum_fn=lambda s, extra=extra: s + extra)
        got.append(adv)
    assert_close(torch.cat(got), expected)


def test_reward_clip_applies_after_the_baseline():
    """compute_reward clips the baselined reward: group_norm's z-scores of a group [0, 0, 0, 10]
    are [-0.5, -0.5, -0.5, 1.5] and clip to [-0.5, -0.5, -0.5, 1] with [-1, 1]; the raw reward 10 is
    never clipped itself."""
    mask = torch.ones(4, 1, dtype=torch.bool)
    r = torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)
    adv, _ = advantages_and_returns("group_norm", r, torch.zeros(4, dtype=torch.long), mask, eps=1e-9,
                                    clip_range=(-1.0, 1.0))
    assert_close(adv, torch.tensor([[-0.5], [-0.5], [-0.5], [1.0]], dtype=torch.float64))
    b = batch(4)
    for orl_name in ("group_norm", "reinforce", "gae"):
        est, kw = MAPPING[orl_name]
        expected = orl_advantages(orl_name, b["rewards"] * 3, b["kl"], b["mask"], b["values"], 0.2,
                                  clip_range=(-0.7, 1.3))
        got = learner_advantages(est, {**b, "rewards": b["rewards"] * 3}, ORDER, kl_coef=0.2,
                                 clip_range=(-0.7, 1.3), **kw)
        assert_close(got, expected)


@pytest.mark.parametrize("coef", [0.5, 0.0, -0.5])
def test_stop_properly_penalty(coef):
    """length_penalty.py: a truncated sample's reward is scaled by coef >= 0, replaced by coef < 0;
    then the estimator runs on the penalised rewards."""
    b = batch(5)
    truncated = torch.zeros(12, dtype=torch.bool)
    truncated[[1, 6, 7]] = True
    r = b["rewards"].clone()
    for j in range(12):
        if truncated[j]:
            r[j] = coef if coef < 0 else r[j] * coef
    assert_close(stop_properly_penalty(b["rewards"], truncated, coef), r)
    assert torch.equal(stop_properly_penalty(b["rewards"], truncated, None), b["rewards"])
    expected = orl_advantages("group_norm", r, b["kl"], b["mask"])
    got = learner_advantages("group_norm", {**b, "rewards": stop_properly_penalty(b["rewards"], truncated, coef)},
                             ORDER, eps=1e-9)
    assert_close(got, expected)


def test_config_knows_every_estimator():
    assert set(ADVANTAGE_ESTIMATORS) == set(ESTIMATORS)
    for est in ESTIMATORS:
        assert LearnerConfig(model_path="m", advantage_estimator=est).advantage_estimator == est


# ---- the KL: controller, estimators, unbiased gradient ------------------------------------------


def test_adaptive_kl_controller_update_rule():
    """AdaptiveKLController.update: value *= 1 + clip(current / target - 1, -0.2, 0.2) * n / horizon."""
    ctl = KLController(0.05, target=0.1, horizon=1000)
    expected = 0.05
    for current, n in [(0.3, 64), (0.11, 64), (0.0, 128), (0.09, 32)]:
        ctl.update(current, n)
        expected *= 1 + min(max(current / 0.1 - 1, -0.2), 0.2) * n / 1000
        assert ctl.value == pytest.approx(expected, rel=1e-12)
    fixed = KLController(0.05)
    fixed.update(0.3, 64)
    assert fixed.value == 0.05


def test_kl_controller_after_step_measures_openrlhfs_kl_and_logs_the_coefficient():
    cfg = LearnerConfig(model_path="m", kl_coef=0.05, kl_target=0.1, kl_horizon=1000, kl_in="reward")
    ctl = KLController.for_run(cfg)
    assert ctl.step_config(cfg).kl_coef == 0.05
    out = ctl.after_step(cfg, {"policy/kl_to_ref_seq_mean": 0.3, "loss/kl": 0.0, "perf/samples": 64.0}, 1, "cpu")
    assert out == {"policy/kl_coef": 0.05}  # the coefficient the step trained with
    assert ctl.value == pytest.approx(0.05 * (1 + 0.2 * 64 / 1000))
    assert ctl.step_config(cfg).kl_coef == ctl.value and cfg.kl_coef == 0.05
    as_loss = cfg.model_copy(update={"kl_in": "loss"})
    ctl2 = KLController.for_run(as_loss)
    ctl2.after_step(as_loss, {"policy/kl_to_ref_seq_mean": 0.3, "loss/kl": 0.05, "perf/samples": 64.0}, 1, "cpu")
    assert ctl2.value == pytest.approx(0.05 * (1 - 0.2 * 64 / 1000))
    # what kl_in="reward" measures: each sample's token mean of the KL, averaged over samples
    kl = torch.tensor([[0.1, 0.3, 0.0], [0.6, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert kl_seq_mean(kl, mask)["policy/kl_to_ref_seq_mean"] == pytest.approx((0.2 + 0.6) / 2)


def test_kl_coefficient_survives_a_checkpoint(tmp_path):
    """The adaptive coefficient is kept in trainer_state.json and a resumed run starts from it."""
    cfg = LearnerConfig(model_path="m", kl_coef=0.05, kl_target=0.1)
    ctl = KLController.for_run(cfg)
    ctl.update(0.5, 5000)
    step = tmp_path / "step_3"
    step.mkdir()
    (step / "trainer_state.json").write_text(json.dumps({"step": 3, **ctl.state()}))
    assert KLController.for_run(cfg, step).value == ctl.value != 0.05
    fixed = cfg.model_copy(update={"kl_target": None})
    assert KLController.for_run(fixed, step).value == 0.05  # a fixed coefficient is the config's
    (step / "trainer_state.json").write_text(json.dumps({"step": 3}))  # saved before the key existed
    assert KLController.for_run(cfg, step).value == 0.05


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_and_their_clip(estimator):
    """compute_approx_kl's values, clipped to [-10, 10], log-ratios from ordinary to extreme."""
    logp = torch.tensor([[-1.0, -2.0, -0.1, -30.0, -0.5, -15.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.1, -0.2, -14.0, -1.0]])
    assert_close(kl_penalty(logp, ref, estimator), orl_approx_kl(logp, ref, estimator))
    bf16 = kl_penalty(logp.bfloat16(), ref.bfloat16(), estimator)  # computed in float32, as OpenRLHF's
    assert bf16.dtype == torch.float32
    assert_close(bf16, orl_approx_kl(logp.bfloat16(), ref.bfloat16(), estimator))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_unbiased_kl_gradient(estimator):
    """--algo.kl.unbiased_gradient: the value is the estimator's; the gradient is that of
    min(pi / pi_old, 10) * (log pi - log ref)^2 / 2, i.e. w * (log pi - log ref) per token."""
    logp0 = torch.tensor([[-1.0, -2.0, -0.3, -0.2]])
    ref = torch.tensor([[-1.5, -1.0, -0.1, -4.0]])
    old = torch.tensor([[-1.2, -2.0, -0.1, -3.0]])  # the last: pi / pi_old = e^2.8 > 10
    logp = logp0.clone().requires_grad_()
    got = kl_penalty(logp, ref, estimator, unbiased_gradient=True, old_logprobs=old)
    got.sum().backward()
    theirs = logp0.clone().requires_grad_()
    expected = orl_approx_kl(theirs, ref, estimator, old, unbiased_gradient=True)
    expected.sum().backward()
    assert_close(got, expected.detach())
    assert_close(logp.grad, theirs.grad)
    w = (logp0 - old).exp().clamp(max=10.0)
    assert_close(logp.grad, w * (logp0 - ref))
    assert w[0, 3] == 10.0


# ---- the policy loss: GSPO, correction gating, clip with a lower bound --------------------------


def loss_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 7
    mask = torch.arange(T).unsqueeze(0) < torch.tensor([[7], [3], [5], [1], [6]])
    probs = lambda: torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05  # noqa: E731
    old = probs().log()
    rollout = (old.exp() * (1 + 0.4 * (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5))).log()  # near pi_old
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T) * mask
    return logp * mask, old * mask, rollout * mask, adv.contiguous(), mask


def grads_of(fn, logp):
    x = logp.clone().requires_grad_()
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("level", ["off", "token"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_gspo_loss_and_gradient(level, dual_clip):
    """GSPO's sequence ratio exp(mean log(pi / base)), base pi_old (level off) or the rollout's mu
    (a correction level set), per-sequence mean aggregation; value and gradient."""
    logp, old, rollout, adv, mask = loss_batch(1)
    base = old if level == "off" else rollout
    got = grads_of(lambda x: gspo_loss(x, base, adv, mask, 0.2, 0.28, dual_clip)[0], logp)
    expected = grads_of(lambda x: orl_policy_loss(x, old, adv, mask, rollout, 0.2, 0.28, dual_clip,
                                                  loss_type="gspo", level=level), logp)
    assert_close(got[0], expected[0])
    assert_close(got[1], expected[1])


# OpenRLHF's (level, mode, gating, threshold) -> the learner's behaviour_correction arguments
GATES = [
    (("token", "mask", "ratio", (0.95, 1.1)), dict(mode="icepop", level="token", low=0.95, high=1.1)),
    (("seq", "mask", "ratio", (0.96, 1.1)), dict(mode="icepop", level="sequence", low=0.96, high=1.1)),
    (("token", "mask", "binary_kl", (0.0, 0.005)), dict(mode="icepop", level="token", gating="binary_kl", low=0.0,
                                                       high=0.005)),
    (("seq", "mask", "binary_kl", (0.0, 0.014)), dict(mode="icepop", level="sequence", gating="binary_kl", low=0.0,
                                                     high=0.014)),
    (("token", "mask", "tv", (0.0, 0.03)), dict(mode="icepop", level="token", gating="tv", low=0.0, high=0.03)),
    (("seq", "mask", "tv", (0.0, 0.05)), dict(mode="icepop", level="sequence", gating="tv", low=0.0, high=0.05)),
    (("token", "clip", "ratio", (0.95, 1.1)), dict(mode="tis", tis_low=0.95, tis_cap=1.1)),
    (("token", "clip", "ratio", (0.0, 1.1)), dict(mode="tis", tis_cap=1.1)),
]


@pytest.mark.parametrize("orl, ours", GATES, ids=[f"{o[0]}-{o[1]}-{o[2]}-{o[3][0]}" for o, _ in GATES])
@pytest.mark.parametrize("token_level", [True, False])
def test_correction_gating_and_clip(orl, ours, token_level):
    """is_correction_* as behaviour_correction's weights times the PPO loss: the divergence gates
    (binary_kl, tv) and the ratio gate by token and by sequence drop units (they still count in the
    denominators: `icepop`), `clip` clamps the token ratio into [LOW, HIGH] (`tis` with tis_low)."""
    level, mode, gating, threshold = orl
    logp, old, rollout, adv, mask = loss_batch(2)
    agg = "token-mean" if token_level else "seq-mean-token-mean"
    weights, loss_mask, metrics = behaviour_correction(old, rollout, mask, **ours)
    assert torch.equal(loss_mask, mask)
    got = grads_of(lambda x: policy_loss(x, old, adv, loss_mask, weights, 0.2, 0.2, None, agg)[0], logp)
    expected = grads_of(lambda x: orl_policy_loss(x, old, adv, mask, rollout, token_level=token_level, level=level,
                                                  mode=mode, gating=gating, threshold=threshold), logp)
    assert_close(got[0], expected[0])
    assert_close(got[1], expected[1])
    # the band is met by some units only, and the clamp bites on some tokens
    assert 0.0 < (metrics["masked_frac"] if mode == "mask" else metrics["capped_frac"]) < 1.0


# ---- in the learner's step ----------------------------------------------------------------------


def test_compute_advantages_penalises_truncated_then_baselines():
    """The learner's step: stop-properly penalty on the truncated completion (finish_reason
    `length`), then OpenRLHF's group_norm with its eps, then the clip; every token of a completion
    gets the same advantage."""
    from learner.batching import to_train_batch
    from learner.trainer import compute_advantages
    from tests.helpers.learner import make_group

    tb = to_train_batch(make_group(0, 4, [1.0, 0.0, 2.0, 0.5], truncated=(2,)))
    cfg = LearnerConfig(model_path="m", advantage_estimator="group_norm", adv_eps=1e-9,
                        stop_properly_penalty_coef=-1.0, reward_clip_range=[-1.2, 1.2])
    adv, _ = compute_advantages(cfg, tb, None)
    r = torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=torch.float64)  # sample 2 truncated: its reward is -1
    expected = ((r - r.mean()) / (r.std() + 1e-9)).clamp(-1.2, 1.2)
    for i in range(4):
        row = adv[i][tb.action_mask[i]]
        assert_close(row.double(), expected[i].expand_as(row))
    assert (adv[~tb.action_mask] == 0).all()


@pytest.mark.parametrize("knobs", [
    dict(policy_loss="gspo", behav_correction="none"),
    dict(policy_loss="gspo", gspo_ratio="behav", behav_correction="none"),
    dict(behav_correction="icepop", behav_gating="binary_kl", behav_low=0.0, behav_high=0.05,
         behav_mask_level="sequence"),
    dict(behav_correction="tis", behav_tis_low=0.5, behav_tis_cap=1.5),
    dict(kl_unbiased_gradient=True, kl_coef=0.1, kl_in="loss", kl_estimator="k1"),
    dict(advantage_estimator="reinforce_baseline", adv_std_norm=False, kl_coef=0.1, kl_in="reward",
         kl_target=0.01, reward_clip_range=[-1.0, 1.0]),
    dict(advantage_estimator="flash_reinforce", stop_properly_penalty_coef=0.5),
])
def test_a_step_with_each_knob_gives_a_finite_loss_and_gradient(tiny_model_dir, knobs):
    """Steps 2-4 of a learner step on the tiny model with each knob on: a finite loss, a nonzero
    finite gradient; GSPO's loss is the GSPO of the step's own log-probs."""
    from learner.batching import to_train_batch
    from learner.modeling import load_causal_lm
    from tests.helpers.learner import make_group, step_loss_and_grads

    model = load_causal_lm(str(tiny_model_dir))
    # group 0 sampled by the model itself (mu = pi_old), group 1 by some other policy (random mu)
    tb = to_train_batch(make_group(0, 4, [1.0, 0.0, 0.5, 0.2], behav_model=model, with_ref=True, truncated=(1,))
                        + make_group(1, 4, [0.0, 0.0, 1.0, 0.3], with_ref=True))
    cfg = LearnerConfig(model_path="m", **knobs)
    b, metrics, loss, parts, grads = step_loss_and_grads(model, cfg, tb)
    assert math.isfinite(float(loss)) and grads
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(float(g.abs().max()) > 0 for g in grads.values())
    if cfg.policy_loss == "gspo":
        base = b.behav_logprobs if cfg.gspo_ratio == "behav" else b.prox_logprobs
        # pi = pi_old at the first pass: GSPO's ratio is 1 (prox) and the loss -(seq-mean of A)
        expected, _ = gspo_loss(b.prox_logprobs, base, b.advantages, b.loss_mask)
        assert float(parts["loss/policy"]) == pytest.approx(float(expected), abs=1e-5)
    if cfg.behav_gating != "ratio":  # the far-off group is gated out, the model's own kept
        assert metrics["policy/masked_frac"] == pytest.approx(float(b.action_mask[4:].sum() / b.action_mask.sum()))
    if cfg.kl_coef > 0 and cfg.kl_in == "reward":
        assert metrics["policy/kl_to_ref_seq_mean"] > 0


@pytest.mark.parametrize("bad, message", [
    (dict(reward_clip_range=[1.0, -1.0]), "reward_clip_range"),
    (dict(reward_clip_range=[1.0]), "reward_clip_range"),
    (dict(stop_properly_penalty_coef=1.5), "stop_properly_penalty_coef"),
    (dict(kl_target=0.1, kl_coef=0.0), "kl_target"),
    (dict(behav_tis_low=2.0, behav_tis_cap=2.0), "behav_tis_low"),
    (dict(behav_gating="tv", behav_correction="tis", behav_low=0.0), "gates a band"),
    (dict(behav_gating="binary_kl", behav_correction="mask"), "upper bound only"),
    (dict(policy_loss="gspo"), "behav_correction='none'"),
    (dict(gspo_ratio="behav"), "needs policy_loss='gspo'"),
    (dict(advantage_estimator="reinforce_plus"), "advantage_estimator"),
    (dict(behav_gating="kl"), "behav_gating"),
])
def test_bad_knob_values_are_refused_by_name(bad, message):
    from common.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match=message):
        LearnerConfig(model_path="m", **bad)


def test_adaptive_kl_coefficient_is_logged_saved_and_resumed(tiny_model_dir, tmp_path):
    """A real learner (a world of one) with kl_target: each step logs the coefficient it trained
    with, the next step's is the controller's update from the step's measured KL and sample count,
    each checkpoint keeps it, and a resumed run trains its first step with the saved one."""
    from learner.checkpoint import read_trainer_state
    from learner.metrics import read_metrics
    from learner.trainer import train
    from tests.helpers.learner import ListSource, make_group

    steps = {s: make_group(2 * s, 4, [1.0, 0.0, 0.5, 0.2], with_ref=True, seed=s)
             + make_group(2 * s + 1, 4, [0.0, 0.3, 1.0, 1.0], with_ref=True, seed=s) for s in range(3)}
    run_dir = tmp_path / "run"
    cfg = LearnerConfig(model_path=str(tiny_model_dir), run_dir=str(run_dir), total_steps=2, save_every=1,
                        advantage_estimator="reinforce_baseline", kl_in="reward", kl_estimator="k1", kl_coef=0.05,
                        kl_target=0.01, kl_horizon=40, lr=1e-3, zero_stage=0, tensorboard=False)
    cfg.validate()
    train(cfg, source=ListSource(steps))
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    coef = 0.05
    for step in (0, 1):
        assert rows[step]["policy/kl_coef"] == pytest.approx(coef, rel=1e-9)
        measured = rows[step]["policy/kl_to_ref_seq_mean"]  # the step's KL to the reference, samples 8
        coef *= 1 + min(max(measured / 0.01 - 1, -0.2), 0.2) * 8 / 40
        saved = read_trainer_state(run_dir / "checkpoints" / f"step_{step + 1}")["kl_coef"]
        assert saved == pytest.approx(coef, rel=1e-9)
    assert coef != pytest.approx(0.05)

    resumed = cfg.model_copy(update={"total_steps": 3, "resume": True})
    train(resumed, source=ListSource(steps))
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    assert rows[2]["policy/kl_coef"] == pytest.approx(coef, rel=1e-9)
