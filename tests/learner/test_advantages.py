"""Advantage estimators against values worked out by hand and a brute-force GAE."""

import pytest
import torch

from learner.advantages import (
    advantages_and_returns,
    batch_mean_advantages,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    stop_properly_penalty,
    token_rewards,
    whiten,
)


def close(x, expected, tol=1e-6):
    """x (a tensor) equals the nested list `expected` to within tol."""
    torch.testing.assert_close(x.double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)
    return True



def test_grpo_constant_group_gives_zero_advantage():
    r = torch.tensor([0.7, 0.7, 0.7, 0.7])
    assert grpo_advantages(r, torch.tensor([3, 3, 3, 3])).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_grpo_by_hand():
    # group 5: [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 9 (interleaved): [2, 4]: mean 3, std sqrt(2) -> -+1 / 1.414214 = -+0.707107
    r = torch.tensor([1.0, 2.0, 0.0, 0.0, 4.0, 1.0])
    g = torch.tensor([5, 9, 5, 5, 9, 5])
    adv = grpo_advantages(r, g, eps=0.0)
    assert adv.tolist() == pytest.approx([0.866025, -0.707107, -0.866025, -0.866025, 0.707107, 0.866025], abs=1e-6)
    # Dr. GRPO: the mean only -> [0.5, -1, -0.5, -0.5, 1, 0.5]
    dr = grpo_advantages(r, g, scale_by_std=False)
    assert dr.tolist() == pytest.approx([0.5, -1.0, -0.5, -0.5, 1.0, 0.5])


def test_group_of_one_has_zero_advantage():
    assert grpo_advantages(torch.tensor([3.0]), torch.tensor([0])).tolist() == [0.0]
    assert rloo_advantages(torch.tensor([3.0]), torch.tensor([0])).tolist() == [0.0]


def test_rloo_by_hand():
    # group 0: [1, 2, 6] -> 1 - (2 + 6)/2 = -3; 2 - (1 + 6)/2 = -1.5; 6 - (1 + 2)/2 = 4.5
    # group 1: [0, 1] -> 0 - 1 = -1; 1 - 0 = 1
    r = torch.tensor([1.0, 0.0, 2.0, 6.0, 1.0])
    g = torch.tensor([0, 1, 0, 0, 1])
    assert rloo_advantages(r, g).tolist() == pytest.approx([-3.0, -1.0, -1.5, 4.5, 1.0])


def test_token_rewards_on_last_token_with_kl():
    # row 0: completion at positions 1..2 (reward 1); row 1: position 0 only (reward -1); KL 0.1 per token, coef 2
    mask = torch.tensor([[False, True, True], [True, False, False]])
    kl = torch.full((2, 3), 0.1)
    tr = token_rewards(torch.tensor([1.0, -1.0]), mask, kl, kl_coef=2.0)
    assert close(tr, [[0.0, -0.2, 0.8], [-1.2, 0.0, 0.0]])


def test_gae_by_hand():
    # r = [0, 0, 1], V = [0.5, 0.5, 0.5], gamma = 1:
    # delta = [0 + 0.5 - 0.5, 0 + 0.5 - 0.5, 1 + 0 - 0.5] = [0, 0, 0.5]
    # lambda = 1: A = [0.5, 0.5, 0.5], R = A + V = [1, 1, 1]
    # lambda = 0.5: A2 = 0.5, A1 = 0 + 0.5 * 0.5 = 0.25, A0 = 0.125
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.full((1, 3), 0.5)
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae_advantages(r, v, mask, gamma=1.0, lam=1.0)
    assert close(adv, [[0.5, 0.5, 0.5]]) and close(ret, [[1.0, 1.0, 1.0]])
    adv, _ = gae_advantages(r, v, mask, gamma=1.0, lam=0.5)
    assert close(adv, [[0.125, 0.25, 0.5]])


def test_gae_matches_brute_force_with_prompts_and_padding():
    g = torch.Generator().manual_seed(0)
    B, T, gamma, lam = 4, 9, 0.9, 0.8
    starts, ends = [0, 2, 3, 5], [9, 6, 4, 9]  # completion span [start, end) of each row
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        mask[b, starts[b]:ends[b]] = True
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    for b in range(B):
        pos = list(range(starts[b], ends[b]))
        for i, t in enumerate(pos):
            # A_t = sum_l (gamma lam)^l delta_{t+l}, delta_s = r_s + gamma V_{s+1} - V_s, V past the end = 0
            expect = 0.0
            for l, s in enumerate(pos[i:]):
                v_next = values[b, s + 1].item() if s + 1 < ends[b] else 0.0
                delta = rewards[b, s].item() + gamma * v_next - values[b, s].item()
                expect += (gamma * lam) ** l * delta
            assert adv[b, t].item() == pytest.approx(expect, abs=1e-9)
            assert ret[b, t].item() == pytest.approx(expect + values[b, t].item(), abs=1e-9)
        outside = ~mask[b]
        assert (adv[b][outside] == 0).all() and (ret[b][outside] == 0).all()


def test_reinforce_plus_plus_by_hand():
    # rewards [1, 0]; row 0 has 2 tokens, row 1 has 1; KL 0.1 per token, coef 1
    # token rewards: row 0 = [-0.1, 0.9], row 1 = [-0.1]; returns (gamma 1): [0.8, 0.9], [-0.1]
    # whitened over the 3 tokens: mean 1.6/3 = 0.533333, deviations [0.266667, 0.366667], [-0.633333],
    # population std sqrt((0.071111 + 0.134444 + 0.401111) / 3) = sqrt(0.202222) = 0.449691
    # -> [0.592999, 0.815374], [-1.408374]
    mask = torch.tensor([[True, True], [True, False]])
    tr = token_rewards(torch.tensor([1.0, 0.0], dtype=torch.float64), mask,
                       torch.full((2, 2), 0.1, dtype=torch.float64), kl_coef=1.0)
    adv, ret = reinforce_pp_advantages(tr, mask, gamma=1.0)
    assert close(ret, [[0.8, 0.9], [-0.1, 0.0]])
    assert close(adv, [[0.592999, 0.815374], [-1.408374, 0.0]])


def test_discounted_returns():
    # r = [1, 2, 3], gamma 0.5: G2 = 3, G1 = 2 + 1.5 = 3.5, G0 = 1 + 1.75 = 2.75
    r = torch.tensor([[1.0, 2.0, 3.0]])
    assert close(discounted_returns(r, torch.ones(1, 3, dtype=torch.bool), 0.5), [[2.75, 3.5, 3.0]])


def test_whiten_across_ranks_equals_whole_batch():
    # two "ranks" holding halves of a batch, with sum_fn adding the other half's statistics,
    # whiten exactly as one rank holding the whole batch
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 5, generator=g) > 0.3
    whole = whiten(x, mask)

    def stats(xs, ms):
        m = ms.to(xs.dtype)
        return torch.stack([(xs * m).sum(), (xs * xs * m).sum(), m.sum()]).double()

    top = whiten(x[:2], mask[:2], sum_fn=lambda s: s + stats(x[2:], mask[2:]))
    bottom = whiten(x[2:], mask[2:], sum_fn=lambda s: s + stats(x[:2], mask[:2]))
    assert torch.allclose(torch.cat([top, bottom]), whole)


def test_token_level_estimators_run_on_the_policys_tokens_of_an_episode():
    """A two-turn episode (policy tokens, 2 environment tokens, policy tokens): GAE and REINFORCE++
    give the policy's tokens what they give the same tokens with the environment's cut out, and 0
    on the environment's (a return bootstraps across the gap instead of stopping at it)."""
    from learner.advantages import on_actions

    mask = torch.tensor([[True, True, False, False, True, True], [True, True, True, False, False, False]])
    r = torch.tensor([[0.0, 0.1, 9.0, 9.0, 0.2, 1.0], [0.3, 0.0, 0.5, 0.0, 0.0, 0.0]])
    v = torch.tensor([[0.5, 0.4, 7.0, 7.0, 0.3, 0.2], [0.1, 0.2, 0.3, 0.0, 0.0, 0.0]])
    cut = torch.tensor([[0.0, 0.1, 0.2, 1.0], [0.3, 0.0, 0.5, 0.0]])  # the policy's tokens only
    cut_v = torch.tensor([[0.5, 0.4, 0.3, 0.2], [0.1, 0.2, 0.3, 0.0]])
    cut_mask = torch.tensor([[True] * 4, [True, True, True, False]])
    adv, ret = on_actions(gae_advantages, mask, r, v, gamma=0.9, lam=0.8)
    want_adv, want_ret = gae_advantages(cut, cut_v, cut_mask, gamma=0.9, lam=0.8)
    assert torch.allclose(adv[mask], want_adv[cut_mask]) and torch.allclose(ret[mask], want_ret[cut_mask])
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    adv, ret = on_actions(reinforce_pp_advantages, mask, r, gamma=0.9)
    assert torch.allclose(ret[mask], discounted_returns(cut, cut_mask, 0.9)[cut_mask])
    # single-turn (the mask contiguous): exactly the estimator's own result
    assert torch.equal(on_actions(gae_advantages, cut_mask, cut, cut_v)[0], gae_advantages(cut, cut_v, cut_mask)[0])


def test_whiten_with_and_without_the_std():
    # [1, 2, 3]: mean 2, population var 2/3 -> [-1, 0, 1] / 0.816497 = [-1.224745, 0, 1.224745]; mean only: [-1, 0, 1]
    x = torch.tensor([[1.0, 2.0, 3.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    assert close(whiten(x, mask), [[-1.224745, 0.0, 1.224745, 0.0]])
    assert close(whiten(x, mask, std_norm=False), [[-1.0, 0.0, 1.0, 0.0]])
    # all equal: var 0 is floored at 1e-8, so the result is 0, not nan
    assert whiten(torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool)).abs().max() == 0


def test_flash_reinforce_subtracts_the_batch_mean():
    # [1, 2, 3, 6]: mean 3 -> [-2, -1, 0, 3], whatever the groups
    assert batch_mean_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0])).tolist() == [-2.0, -1.0, 0.0, 3.0]


def test_stop_properly_penalty_by_hand():
    r, cut = torch.tensor([1.0, 0.8, -0.4]), torch.tensor([False, True, True])
    assert stop_properly_penalty(r, cut, 0.5).tolist() == pytest.approx([1.0, 0.4, -0.2])
    assert stop_properly_penalty(r, cut, -1.0).tolist() == [1.0, -1.0, -1.0]


def test_kl_in_the_reward_of_a_group_estimator_is_per_token():
    # rewards [1, 0] in one group: GRPO gives +-0.5 / sqrt(0.5) = +-0.707107; KL 0.1 per token, coef 1, on
    # 2 tokens each: a token's advantage is that minus the KL from it to the end:
    # row 0: [0.707107 - 0.2, 0.707107 - 0.1]; row 1: [-0.707107 - 0.2, -0.707107 - 0.1]
    mask = torch.ones(2, 2, dtype=torch.bool)
    kl = torch.full((2, 2), 0.1, dtype=torch.float64)
    adv, _ = advantages_and_returns("grpo", torch.tensor([1.0, 0.0], dtype=torch.float64), torch.zeros(2), mask,
                                    kl, kl_coef=1.0, eps=0.0)
    assert close(adv, [[0.507107, 0.607107], [-0.907107, -0.807107]])
    plain, _ = advantages_and_returns("grpo", torch.tensor([1.0, 0.0], dtype=torch.float64), torch.zeros(2), mask,
                                      eps=0.0)
    assert close(plain, [[0.707107, 0.707107], [-0.707107, -0.707107]])
