"""Losses against values worked out by hand (in the comments)."""

import math

import pytest
import torch

from learner.losses import (
    aggregate,
    behaviour_correction,
    gate_statistic,
    gspo_loss,
    kl_penalty,
    policy_loss,
    value_loss,
)

LN = math.log

def close(x, expected, tol=1e-6):
    """x (a tensor) equals the nested list `expected` to within tol."""
    torch.testing.assert_close(x.double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)
    return True



def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_ratio_one_and_weight_one_is_plain_policy_gradient():
    # pi = pi_old, w = 1: L = -mean(A) and dL/dlogpi_t = -A_t / n.
    # A = [1, -2, 0.5] -> L = -(1 - 2 + 0.5) / 3 = 0.5 / 3; grad = [-1/3, 2/3, -1/6]
    logp = t([-1.0, -2.0, -0.5]).requires_grad_()
    A = t([1.0, -2.0, 0.5])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = policy_loss(logp, logp.detach(), A, mask, weights=torch.ones(1, 3, dtype=torch.float64))
    loss.backward()
    assert loss.item() == pytest.approx(0.5 / 3)
    assert close(logp.grad, [[-1 / 3, 2 / 3, -1 / 6]])
    assert m["clip_frac"] == 0 and m["ratio_mean"] == pytest.approx(1.0)


def test_ppo_clip_stops_gradient_beyond_the_band():
    # A = 1: r = 1.5 > 1.2 -> min(1.5, 1.2) = 1.2 is clipped, no gradient; r = 0.5 -> unclipped 0.5.
    # L = -(1.2 + 0.5) / 2 = -0.85; dL/dlogpi = [0, -r/2] = [0, -0.25]; clip_frac = 1/2
    prox = t([LN(0.4), LN(0.4)])
    logp = (prox + t([LN(1.5), LN(0.5)])).requires_grad_()
    loss, m = policy_loss(logp, prox, t([1.0, 1.0]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert loss.item() == pytest.approx(-0.85)
    assert close(logp.grad, [[0.0, -0.25]])
    assert m["clip_frac"] == pytest.approx(0.5)


def test_dual_clip_caps_negative_advantage_loss():
    # A = -1, r = e^2 = 7.389: ordinary clipped loss max(-A r, -A clip(r)) = max(7.389, 1.2) = 7.389;
    # dual clip c = 3 caps it at -c A = 3.
    prox = t([-1.0])
    logp = prox + 2.0
    mask = torch.ones(1, 1, dtype=torch.bool)
    plain, _ = policy_loss(logp, prox, t([-1.0]), mask)
    dual, m = policy_loss(logp, prox, t([-1.0]), mask, dual_clip_c=3.0)
    assert plain.item() == pytest.approx(math.exp(2))
    assert dual.item() == pytest.approx(3.0)
    assert m["dual_clip_frac"] == 1.0
    # positive advantages are untouched by dual clip: A = 1, r = e^2 -> clipped to 1.2 -> L = -1.2
    pos, _ = policy_loss(logp, prox, t([1.0]), mask, dual_clip_c=3.0)
    assert pos.item() == pytest.approx(-1.2)


def _w(*ws):
    """prox/behav log-probs whose ratio pi_old / mu is `ws`."""
    behav = t([LN(0.1)] * len(ws))
    return behav + t([LN(w) for w in ws]), behav


def test_tis_caps_weights():
    # w = [4, 0.5, 1], C = 2 -> [2, 0.5, 1]; with r = 1 and A = 1: L = -(2 + 0.5 + 1) / 3
    prox, behav = _w(4.0, 0.5, 1.0)
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, loss_mask, m = behaviour_correction(prox, behav, mask, "tis", tis_cap=2.0)
    assert close(w, [[2.0, 0.5, 1.0]])
    assert loss_mask.all()
    assert m["capped_frac"] == pytest.approx(1 / 3) and m["masked_frac"] == 0
    loss, _ = policy_loss(prox, prox, t([1.0, 1.0, 1.0]), loss_mask, w)
    assert loss.item() == pytest.approx(-3.5 / 3)


def test_none_ignores_behaviour():
    prox, behav = _w(4.0, 0.5)
    w, loss_mask, m = behaviour_correction(prox, behav, torch.ones(1, 2, dtype=torch.bool), "none")
    assert w.tolist() == [[1.0, 1.0]] and loss_mask.all() and m["ess"] == 1.0


def test_mask_token_level_drops_tokens_outside_band():
    # w = [4, 0.5, 1], band [0.6, 2]: only the third token is kept; it is also the only one counted,
    # so with A = 1, r = 1: L = -(1 * 1) / 1 = -1; masked_frac = 2/3
    prox, behav = _w(4.0, 0.5, 1.0)
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, loss_mask, m = behaviour_correction(prox, behav, mask, "mask", low=0.6, high=2.0, level="token")
    assert close(w, [[0.0, 0.0, 1.0]])
    assert loss_mask.tolist() == [[False, False, True]]
    assert m["masked_frac"] == pytest.approx(2 / 3)
    loss, _ = policy_loss(prox, prox, t([1.0, 1.0, 1.0]), loss_mask, w)
    assert loss.item() == pytest.approx(-1.0)


def test_mask_sequence_level_uses_geometric_mean():
    # seq 0: w = [4, 0.25] -> geometric mean sqrt(4 * 0.25) = 1, kept (w stays [4, 0.25]);
    # seq 1: w = [4, 4] -> 4 > 2, the whole sequence dropped
    prox0, behav0 = _w(4.0, 0.25)
    prox1, behav1 = _w(4.0, 4.0)
    prox, behav = torch.cat([prox0, prox1]), torch.cat([behav0, behav1])
    mask = torch.ones(2, 2, dtype=torch.bool)
    w, loss_mask, m = behaviour_correction(prox, behav, mask, "mask", low=0.5, high=2.0, level="sequence")
    assert close(w, [[4.0, 0.25], [0.0, 0.0]])
    assert loss_mask.tolist() == [[True, True], [False, False]]
    assert m["masked_frac"] == pytest.approx(0.5)


def test_icepop_zeroes_tokens_but_keeps_them_in_the_mean():
    # IcePop: M(w) = w inside [0.5, 5], else 0. w = [8, 0.6, 2] -> [0, 0.6, 2]; the zeroed token still
    # counts in the token mean: A = 1, r = 1 -> L = -(0 + 0.6 + 2) / 3
    prox, behav = _w(8.0, 0.6, 2.0)
    mask = torch.ones(1, 3, dtype=torch.bool)
    w, loss_mask, m = behaviour_correction(prox, behav, mask, "icepop", low=0.5, high=5.0)
    assert close(w, [[0.0, 0.6, 2.0]])
    assert loss_mask.all()
    assert m["masked_frac"] == pytest.approx(1 / 3)
    loss, _ = policy_loss(prox, prox, t([1.0, 1.0, 1.0]), loss_mask, w)
    assert loss.item() == pytest.approx(-2.6 / 3)


def test_ess_and_behaviour_kl():
    # w = [1, 3]: ESS = (1 + 3)^2 / (2 * (1 + 9)) = 16 / 20 = 0.8
    # KL(mu || pi_old) by k3 = mean(w - 1 - ln w) = (0 + 2 - ln 3) / 2
    prox, behav = _w(1.0, 3.0)
    _, _, m = behaviour_correction(prox, behav, torch.ones(1, 2, dtype=torch.bool), "tis", tis_cap=10.0)
    assert m["ess"] == pytest.approx(0.8)
    assert m["behav_prox_kl"] == pytest.approx((2 - LN(3)) / 2)
    # padding does not count: a third, masked-out token with a wild ratio changes nothing
    prox3 = torch.cat([prox, t([5.0])], -1)
    behav3 = torch.cat([behav, t([-5.0])], -1)
    _, _, m3 = behaviour_correction(prox3, behav3, torch.tensor([[True, True, False]]), "tis", tis_cap=10.0)
    assert m3["ess"] == pytest.approx(0.8)


def test_aggregations():
    # values [[1, 2, 3], [4, -, -]]:
    # token-mean = (1 + 2 + 3 + 4) / 4 = 2.5; seq-mean-token-mean = (2 + 4) / 2 = 3;
    # seq-mean-token-sum = (6 + 4) / 2 = 5; token-mean with an outside denominator of 8 = 10 / 8
    v = t([1.0, 2.0, 3.0], [4.0, 9.0, 9.0])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert aggregate(v, mask, "token-mean").item() == pytest.approx(2.5)
    assert aggregate(v, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate(v, mask, "seq-mean-token-sum").item() == pytest.approx(5.0)
    assert aggregate(v, mask, "token-mean", num_tokens=8.0).item() == pytest.approx(1.25)
    assert aggregate(v, mask, "seq-mean-token-sum", num_seqs=4.0).item() == pytest.approx(2.5)


def test_kl_estimators():
    # pi = 0.5, ref = 0.25: log r = ln(ref / pi) = ln 0.5 = -0.693147
    # k1 = -log r = 0.693147; k2 = (log r)^2 / 2 = 0.240227; k3 = (r - 1) - log r = -0.5 + 0.693147 = 0.193147
    logp, ref = t([LN(0.5)]), t([LN(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.693147, abs=1e-6)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.240227, abs=1e-6)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.193147, abs=1e-6)
    # identical policies: every estimator is 0
    for k in ("k1", "k2", "k3"):
        assert kl_penalty(logp, logp, k).item() == 0.0


def test_clipped_value_loss():
    # V_old = 1, R = 2, eps = 0.2.
    # V = 1.5: unclipped (1.5 - 2)^2 = 0.25, clipped V = 1.2 -> (1.2 - 2)^2 = 0.64; 0.5 * max = 0.32
    # V = 1.1: inside the band, both 0.81 -> 0.405; mean over the two tokens = 0.3625
    values = t([1.5, 1.1]).requires_grad_()
    loss, m = value_loss(values, t([1.0, 1.0]), t([2.0, 2.0]), torch.ones(1, 2, dtype=torch.bool), clip_eps=0.2)
    assert loss.item() == pytest.approx((0.32 + 0.405) / 2)
    assert m["value_clip_frac"] == pytest.approx(0.5)
    loss.backward()
    # the clipped token gives no gradient; the other: d/dV 0.5 (V - 2)^2 / 2 = (1.1 - 2) / 2 = -0.45
    assert close(values.grad, [[0.0, -0.45]])


def test_tis_with_a_floor_clamps_both_sides():
    # w = [0.25, 1, 4] in [0.5, 2] -> [0.5, 1, 2]; 2 of 3 clamped
    prox = t([LN(0.25), 0.0, LN(4.0)])
    w, loss_mask, m = behaviour_correction(prox, torch.zeros(1, 3, dtype=torch.float64),
                                           torch.ones(1, 3, dtype=torch.bool), "tis", tis_cap=2.0, tis_low=0.5)
    assert close(w, [[0.5, 1.0, 2.0]]) and loss_mask.all()
    assert m["capped_frac"] == pytest.approx(2 / 3)


def test_gate_statistics_by_hand():
    # mu = 0.5, pi_old = 0.25: ratio 0.5; binary KL 0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75) = 0.346574 - 0.202733
    # = 0.143841; tv |0.5 - 0.25| = 0.25. Second token mu = pi_old: 1, 0, 0. Per sequence: geometric mean of the
    # ratio sqrt(0.5) = 0.707107, the divergences' means 0.071921 and 0.125
    prox, behav = t([LN(0.25), LN(0.3)]), t([LN(0.5), LN(0.3)])
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert close(gate_statistic(prox, behav, mask, "ratio"), [[0.5, 1.0]])
    assert close(gate_statistic(prox, behav, mask, "binary_kl"), [[0.143841, 0.0]])
    assert close(gate_statistic(prox, behav, mask, "tv"), [[0.25, 0.0]])
    assert close(gate_statistic(prox, behav, mask, "ratio", "sequence"), [[0.707107]])
    assert close(gate_statistic(prox, behav, mask, "binary_kl", "sequence"), [[0.071921]])
    assert close(gate_statistic(prox, behav, mask, "tv", "sequence"), [[0.125]])


def test_icepop_by_sequence_zeroes_whole_sequences_that_still_count():
    # row 0: w = [2, 2] (geometric mean 2, outside [0.5, 1.5]) -> zeroed; row 1: w = [0.8, 1.25] (mean 1) -> kept
    prox = t([LN(2.0), LN(2.0)], [LN(0.8), LN(1.25)])
    w, loss_mask, m = behaviour_correction(prox, torch.zeros(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=bool),
                                           "icepop", low=0.5, high=1.5, level="sequence")
    assert close(w, [[0.0, 0.0], [0.8, 1.25]]) and loss_mask.all()
    assert m["masked_frac"] == 0.5


def test_kl_estimates_are_clipped_to_ten():
    # log pi - log ref = 15: k1 = 15 -> 10; k2 = 112.5 -> 10; k3 = e^-15 - 1 + 15 = 14.0 -> 10
    logp, ref = t([0.0]), t([-15.0])
    for k in ("k1", "k2", "k3"):
        assert kl_penalty(logp, ref, k).item() == 10.0


def test_gspo_by_hand():
    # one sequence, token log-ratios [ln 2, 0]: s = exp(ln 2 / 2) = 1.414214 on both tokens.
    # A = 1: clipped to 1.2 -> L = -1.2, no gradient. A = -1: L = s = 1.414214, and each token's log-prob
    # moves s by s / 2, the loss being the mean of the two tokens' s: dL/dlogpi_t = 0.707107
    prox = t([-1.0, -1.0])
    mask = torch.ones(1, 2, dtype=torch.bool)
    for a, loss_expected, grad_expected in [(1.0, -1.2, 0.0), (-1.0, 1.414214, 0.707107)]:
        logp = (prox + t([LN(2.0), 0.0])).requires_grad_()
        loss, m = gspo_loss(logp, prox, t([a, a]), mask)
        loss.backward()
        assert loss.item() == pytest.approx(loss_expected, abs=1e-6)
        assert close(logp.grad, [[grad_expected, grad_expected]])
        assert m["ratio_mean"] == pytest.approx(1.414214, abs=1e-6)
