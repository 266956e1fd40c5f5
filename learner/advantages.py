"""Advantage estimators: pure functions of tensors.

Sequence-level estimators (GRPO, Dr. GRPO, RLOO, plain REINFORCE) take one reward per completion
(B,) and the prompt group of each (B,) and return one advantage per completion (B,), which
`broadcast` spreads over the completion's tokens. Token-level ones (GAE, REINFORCE++) take a
per-token reward (B, T) built by `token_rewards` and a completion mask (B, T).

Batch statistics (REINFORCE++'s and PPO's whitening) can span several learner ranks: pass
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


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6, sum_fn: SumFn | None = None,
           shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries (of all ranks when `sum_fn` sums over them).

    The std is the population one (divides by n). (B, T) -> (B, T), 0 off the mask.
    """
    m = mask.to(x.dtype)
    stats = torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()]).double()
    if sum_fn is not None:
        stats = sum_fn(stats)
    s, sq, n = stats.unbind()
    n = n.clamp_min(1.0)
    mean = s / n
    std = (sq / n - mean * mean).clamp_min(0.0).sqrt()
    out = (x - mean.to(x.dtype)) if shift_mean else x
    return out / (std.to(x.dtype) + eps) * m


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, eps: float = 1e-6,
    sum_fn: SumFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: the discounted return of the KL-shaped per-token reward, whitened over the batch.

    token_rewards (B, T) from `token_rewards` (reward on the last token, -beta KL on each);
    returns (advantages, returns), each (B, T).
    """
    returns = discounted_returns(token_rewards, mask, gamma)
    return whiten(returns, mask, eps, sum_fn), returns


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
