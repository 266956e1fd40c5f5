"""Advantage estimators: pure functions of tensors.

`advantages_and_returns` is the whole path from one reward per completion to per-token advantages,
in OpenRLHF's order (its `compute_advantages_and_returns` and `compute_reward`):

  1. a baseline per completion (B,) -> (B,): the prompt group's mean (`dr_grpo`,
     `reinforce_baseline`), mean and std (`grpo` = `group_norm`), the others' mean (`rloo`), the
     whole batch's mean (`flash_reinforce`), or none (`reinforce`, `reinforce_pp`, `gae`);
  2. the result clipped to `clip_range` (OpenRLHF's reward clip: after the baseline);
  3. a per-token reward (B, T): that value on the completion's last token, minus kl_coef * KL on
     every token when the KL is folded into the reward (`token_rewards`);
  4. GAE with the critic's values (`gae`), else the return to go (discounted by gamma for
     `reinforce_pp` only; with no KL every token of a completion gets its value of step 2);
  5. whitened over the batch's tokens (`gae`, `reinforce_pp`, `reinforce_baseline`): minus the
     mean, and with `std_norm` times 1 / sqrt(max(var, 1e-8)).

Batch statistics (whitening, flash_reinforce's mean) can span several learner ranks: pass
`sum_fn`, which sums a tensor over the ranks (an all-reduce); None means this batch only.

Multi-turn episodes interleave the policy's tokens with an environment's: the mask is then the
policy's tokens only (`TrainBatch.action_mask`), and the token-level estimators run on each row's
policy tokens moved together (`on_actions`), as if the environment's tokens were not there:
the return of a turn's last token bootstraps from the next turn's first, not from a zero.
"""

from __future__ import annotations

from typing import Callable

import torch

SumFn = Callable[[torch.Tensor], torch.Tensor]


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group sum and group sum of squares, each (B,)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,) index of each sample's group
    G = int(inverse.max()) + 1 if inverse.numel() else 0
    r = rewards.double()
    count = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    total = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inverse, r)
    sq = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inverse, r * r)
    return count[inverse], total[inverse], sq[inverse]


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps); with scale_by_std=False, Dr. GRPO's r - group mean.

    The std is the unbiased one (n - 1), as torch.std; a group of one has advantage 0.
    rewards, group_ids: (B,) -> (B,).
    """
    n, s, sq = _group_stats(rewards, group_ids)
    mean = s / n
    adv = rewards.double() - mean
    if scale_by_std:
        var = ((sq - n * mean * mean) / (n - 1).clamp_min(1)).clamp_min(0.0)
        adv = adv / (var.sqrt() + eps)
    return adv.where(n > 1, torch.zeros_like(adv)).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i - mean of the other samples of its group = n / (n - 1) * (r_i - group mean).

    rewards, group_ids: (B,) -> (B,); a group of one has advantage 0.
    """
    n, s, _ = _group_stats(rewards, group_ids)
    r = rewards.double()
    adv = r - (s - r) / (n - 1).clamp_min(1)
    return adv.where(n > 1, torch.zeros_like(adv)).to(rewards.dtype)


def broadcast(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) per completion -> (B, T) on its tokens, 0 elsewhere."""
    return seq_values.unsqueeze(-1) * mask.to(seq_values.dtype)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask -> (B,) position of each row's last True (0 for an empty row)."""
    T = mask.shape[-1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), pos, torch.zeros_like(pos)).max(-1).values


def token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token reward (B, T): the completion's reward on its last token, minus kl_coef * KL on every token.

    rewards (B,), mask (B, T), kl (B, T) per-token KL estimate to the reference (or None).
    """
    m = mask.to(rewards.dtype)
    out = torch.zeros_like(m)
    out.scatter_(1, last_token_index(mask).unsqueeze(-1), rewards.unsqueeze(-1))
    out = out * m  # an empty row gets nothing
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.to(out.dtype) * m
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s over each completion's tokens. (B, T) -> (B, T)."""
    m = mask.to(token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])  # (B,)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] * m[:, t] + gamma * running * m[:, t]
        out[:, t] = running
    return out


# whitening divides by sqrt(max(var, this)) (OpenRLHF's floor), so a batch of equal values stays finite
WHITEN_VAR_FLOOR = 1e-8


def whiten(x: torch.Tensor, mask: torch.Tensor, sum_fn: SumFn | None = None, std_norm: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(max(var, 1e-8)) over the masked entries (of all ranks when `sum_fn` sums
    over them); std_norm=False: x - mean only (OpenRLHF's no_std_norm).

    The variance is the population one (divides by n). (B, T) -> (B, T), 0 off the mask.
    """
    m = mask.to(x.dtype)
    stats = torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()]).double()
    if sum_fn is not None:
        stats = sum_fn(stats)
    s, sq, n = stats.unbind()
    n = n.clamp_min(1.0)
    mean = s / n
    out = x - mean.to(x.dtype)
    if std_norm:
        var = (sq / n - mean * mean).clamp_min(WHITEN_VAR_FLOOR)
        out = out * var.rsqrt().to(x.dtype)
    return out * m


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, sum_fn: SumFn | None = None,
    std_norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: the discounted return of the KL-shaped per-token reward, whitened over the batch.

    token_rewards (B, T) from `token_rewards` (reward on the last token, -beta KL on each);
    returns (advantages, returns), each (B, T).
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return whiten(returns, mask, sum_fn, std_norm), returns


def on_actions(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
               *per_token: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn(*per_token, mask, **kw)` (a token-level estimator: two (B, T) results) run on each row's
    masked tokens moved to its front, in order, and put back in place (0 elsewhere). Where each
    row's masked tokens are already contiguous (single-turn), the result is `fn`'s own."""
    order = torch.argsort((~mask.bool()).to(torch.int8), dim=1, stable=True)  # (B, T) masked first
    packed = [x.gather(1, order) for x in per_token]
    out = fn(*packed, mask.gather(1, order), **kw)
    back = []
    for y in out:
        full = torch.zeros_like(y)
        back.append(full.scatter_(1, order, y) * mask.to(y.dtype))
    return back[0], back[1]


def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each completion's tokens.

    delta_t = r_t + gamma V_{t+1} - V_t (V after the last token is 0), A_t = sum_l (gamma lam)^l delta_{t+l};
    returns R_t = A_t + V_t (the critic's target). token_rewards, values, mask: (B, T) -> two (B, T).
    The completion tokens of a row are contiguous (prompt before, padding after).
    """
    m = mask.to(values.dtype)
    values = values.detach() * m
    T = values.shape[1]
    adv = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])  # (B,) A_{t+1}
    for t in reversed(range(T)):
        nxt = m[:, t + 1] if t + 1 < T else torch.zeros_like(last)  # is t+1 still in the completion?
        next_value = values[:, t + 1] * nxt if t + 1 < T else torch.zeros_like(last)
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last * nxt) * m[:, t]
        adv[:, t] = last
    return adv, (adv + values) * m


def batch_mean_advantages(rewards: torch.Tensor, sum_fn: SumFn | None = None) -> torch.Tensor:
    """FlashREINFORCE: r - the mean reward of the whole batch (all ranks with `sum_fn`). (B,) -> (B,)."""
    stats = torch.stack([rewards.double().sum(), torch.tensor(float(rewards.numel()), dtype=torch.float64,
                                                              device=rewards.device)])
    if sum_fn is not None:
        stats = sum_fn(stats)
    return (rewards.double() - stats[0] / stats[1].clamp_min(1.0)).to(rewards.dtype)


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float | None) -> torch.Tensor:
    """ProRL's penalty on completions cut at the length limit (finish_reason `length`), before any
    baseline: coef in [0, 1] scales their reward, a negative coef replaces it. None: unchanged. (B,) -> (B,)."""
    if coef is None:
        return rewards
    penalised = rewards * coef if coef >= 0 else torch.full_like(rewards, coef)
    return torch.where(truncated.bool(), penalised, rewards)


# the estimators: what step 1 subtracts, and which ones step 5 whitens (see the module docstring)
GROUP_MEAN = ("dr_grpo", "reinforce_baseline")
GROUP_NORM = ("grpo", "group_norm")
WHITENED = ("gae", "reinforce_pp", "reinforce_baseline")
ESTIMATORS = (*GROUP_NORM, *GROUP_MEAN, "rloo", "flash_reinforce", "reinforce", "reinforce_pp", "gae")


def baselined(estimator: str, rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6,
              sum_fn: SumFn | None = None) -> torch.Tensor:
    """Step 1: each completion's reward minus the estimator's baseline. (B,) -> (B,)."""
    if estimator in GROUP_NORM:
        return grpo_advantages(rewards, group_ids, eps)
    if estimator in GROUP_MEAN:
        return grpo_advantages(rewards, group_ids, eps, scale_by_std=False)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_ids)
    if estimator == "flash_reinforce":
        return batch_mean_advantages(rewards, sum_fn)
    if estimator in ("reinforce", "reinforce_pp", "gae"):
        return rewards
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {list(ESTIMATORS)}")


def advantages_and_returns(
    estimator: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = 1e-6,
    std_norm: bool = True,
    clip_range: tuple[float, float] | None = None,
    sum_fn: SumFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-5 of the module docstring: (advantages, returns), each (B, T), 0 off `mask`.

    rewards, group_ids (B,); mask (B, T) the policy's tokens; kl (B, T) the per-token KL to the
    reference folded into the reward with weight kl_coef (None or kl_coef <= 0: not folded);
    values (B, T) the critic's (gae only); eps the group std's epsilon (grpo).
    """
    r = baselined(estimator, rewards, group_ids, eps, sum_fn)  # (B,)
    if clip_range is not None:
        r = r.clamp(clip_range[0], clip_range[1])
    per_token = token_rewards(r, mask, kl if kl_coef > 0 else None, kl_coef)  # (B, T)
    if estimator == "gae":
        adv, returns = on_actions(gae_advantages, mask, per_token, values, gamma=gamma, lam=lam)
    else:
        # only REINFORCE++ discounts (OpenRLHF sets gamma to 1 for the baselined estimators)
        g = gamma if estimator == "reinforce_pp" else 1.0
        returns, _ = on_actions(lambda x, m: (discounted_returns(x, m, g), x), mask, per_token)
        adv = returns
    if estimator in WHITENED:
        adv = whiten(adv, mask, sum_fn, std_norm)
    return adv, returns
