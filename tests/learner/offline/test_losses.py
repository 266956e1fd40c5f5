"""Offline losses (DPO, IPO, cDPO, Bradley-Terry, SFT) against values worked out by hand (in the comments)."""

import math

import pytest
import torch

from learner.offline.datasets import Encoded
from learner.offline.dpo import dpo_loss
from learner.offline.loop import pack_batch, pad_batch
from learner.offline.rm import bradley_terry_loss
from learner.offline.sft import sft_loss


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))  # -log sigmoid(-x)


def test_dpo_sigmoid_loss_and_rewards():
    # pair 0: policy (-5, -9), ref (-6, -8): h = (-5 + 6) - (-9 + 8) = 1 + 1 = 2; beta 0.5 -> beta h = 1
    #   loss = -log sigmoid(1) = log(1 + e^-1) = 0.3132617; rewards 0.5 * 1 = 0.5 and 0.5 * -1 = -0.5
    # pair 1: policy (-7, -7), ref (-7, -7): h = 0 -> loss = log 2 = 0.6931472; rewards 0 and 0
    # pair 2: policy (-4, -3), ref (-3, -4): h = -1 - 1 = -2 -> loss = log(1 + e^1) = 1.3132617
    pc, pr, rc, rr = t(-5, -7, -4), t(-9, -7, -3), t(-6, -7, -3), t(-8, -7, -4)
    losses, cr, rj = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert losses.tolist() == pytest.approx([0.3132617, 0.6931472, 1.3132617], abs=1e-6)
    assert cr.tolist() == pytest.approx([0.5, 0.0, -0.5]) and rj.tolist() == pytest.approx([-0.5, 0.0, 0.5])


def test_dpo_gradient_pushes_chosen_up_and_rejected_down():
    # d/dpc [-log sigmoid(beta h)] = -beta (1 - sigmoid(beta h)); at h = 0 with beta 0.1: -0.1 * 0.5 = -0.05
    pc, pr = t(-3.0).requires_grad_(), t(-3.0).requires_grad_()
    losses, _, _ = dpo_loss(pc, pr, t(-3.0), t(-3.0), beta=0.1)
    losses.sum().backward()
    assert pc.grad.item() == pytest.approx(-0.05) and pr.grad.item() == pytest.approx(0.05)


def test_conservative_dpo_label_smoothing():
    # h = 2, beta 0.5 (beta h = 1), eps = 0.1:
    #   0.9 * log(1 + e^-1) + 0.1 * log(1 + e^1) = 0.9 * 0.3132617 + 0.1 * 1.3132617 = 0.4132617
    losses, _, _ = dpo_loss(t(-5), t(-9), t(-6), t(-8), beta=0.5, label_smoothing=0.1)
    assert losses.item() == pytest.approx(0.4132617, abs=1e-6)
    # at eps = 0.5 the loss is symmetric in h: 0.5 (softplus(-1) + softplus(1)) for h = +2 and h = -2
    a, _, _ = dpo_loss(t(-5), t(-9), t(-6), t(-8), beta=0.5, label_smoothing=0.5)
    b, _, _ = dpo_loss(t(-9), t(-5), t(-8), t(-6), beta=0.5, label_smoothing=0.5)
    assert a.item() == pytest.approx(0.5 * (softplus(-1) + softplus(1))) and a.item() == pytest.approx(b.item())


def test_ipo_loss():
    # IPO: (h - 1 / (2 beta))^2. h = 2: beta 0.25 -> (2 - 2)^2 = 0; beta 0.5 -> (2 - 1)^2 = 1;
    # beta 1 -> (2 - 0.5)^2 = 2.25. h = 0, beta 0.5 -> (0 - 1)^2 = 1
    for beta, want in ((0.25, 0.0), (0.5, 1.0), (1.0, 2.25)):
        losses, _, _ = dpo_loss(t(-5), t(-9), t(-6), t(-8), beta=beta, loss="ipo")
        assert losses.item() == pytest.approx(want)
    losses, _, _ = dpo_loss(t(-7), t(-7), t(-7), t(-7), beta=0.5, loss="ipo")
    assert losses.item() == pytest.approx(1.0)


def test_bradley_terry_without_and_with_margin():
    # r_c - r_r = 2 - 1 = 1: -log sigmoid(1) = 0.3132617; with margin 1: -log sigmoid(0) = log 2 = 0.6931472
    # r_c - r_r = 0.5 - 3 = -2.5: log(1 + e^2.5) = log 13.18249 = 2.5788897; margin 0.5: log(1 + e^3) = 3.0485874
    rc, rr = t(2.0, 0.5), t(1.0, 3.0)
    assert bradley_terry_loss(rc, rr).tolist() == pytest.approx([0.3132617, 2.5788897], abs=1e-6)
    assert bradley_terry_loss(rc, rr, t(1.0, 0.5)).tolist() == pytest.approx([0.6931472, 3.0485874], abs=1e-6)


def test_sft_loss_counts_only_target_tokens():
    # log-probs [[-1, -2, -3], [-4, -5, -6]], targets on -2, -3 and -6: (2 + 3 + 6) / denom; denom 3 -> 11/3
    lp = t(-1, -2, -3).unsqueeze(0).repeat(2, 1)
    lp[1] = t(-4, -5, -6)
    target = torch.tensor([[False, True, True], [False, False, True]])
    assert sft_loss(lp, target, 3.0).item() == pytest.approx(11 / 3)


def test_pad_and_pack_place_targets_one_to_the_left():
    # a = <s> 5 6 (response: 6), b = <s> 7 (response: 7). The logits at t predict token t + 1, so
    # padded: target rows are [F, T] for a and [T, F] for b (b's position 1 is padding)
    a, b = Encoded([1, 5, 6], [0, 0, 1]), Encoded([1, 7], [0, 1])
    ids, attn, target = pad_batch([a, b], pad_id=0, device="cpu")
    assert ids.tolist() == [[1, 5, 6], [1, 7, 0]] and attn.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert target.tolist() == [[False, True], [True, False]]
    # packed: one row 1 5 6 1 7, positions 0 1 2 0 1; targets at positions 1 (-> 6) and 3 (-> 7);
    # position 2 -> the next document's <s> is not a target
    ids, pos, target = pack_batch([a, b], device="cpu")
    assert ids.tolist() == [[1, 5, 6, 1, 7]] and pos.tolist() == [[0, 1, 2, 0, 1]]
    assert target.tolist() == [[False, True, False, True]]
