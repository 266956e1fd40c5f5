"""Micro-batches cut by a token budget (`learner.max_tokens_per_micro_batch`; OpenRLHF's dynamic batch).

By count (the default), a mini-batch of this rank's share is split into gradient_accumulation_steps
micro-batches of about as many rows (re-dealt with `learner.packing.regroup` when packing), however
long they are. With a budget, it is cut into the fewest micro-batches whose forward holds at most
`budget` positions:

    padded rows      rows x the longest of them (the (b, L) frame the forward runs on); the rows
                     are taken longest first, so each micro-batch holds rows of about one length
    packing          the sum of the lengths: each micro-batch is packed into one row (capacity
                     max(budget, longest)), as OpenRLHF packs its dynamic micro-batches

A sequence longer than the budget gets a micro-batch of its own (`perf/over_budget_samples`).

Every rank must run as many forwards and backwards (ZeRO gathers parameters and reduces gradients
in them), so the count is the largest any rank needs, and at least gradient_accumulation_steps; a
rank that needs fewer splits its fullest micro-batches, and one with fewer rows than that count runs
a row again with its loss mask emptied (a filler: it adds nothing to the gradient).

No loss is rescaled. Every micro-batch's loss is normalised by the whole mini-batch's counts over
all ranks, with DeepSpeed's 1 / gradient_accumulation_steps folded in
(`learner.trainer.mini_batch_denominators`), so the summed gradient is the same whatever the cut;
only the optimizer step is placed by hand (`MicroBatches.boundary`), since DeepSpeed would step
every gradient_accumulation_steps backwards. The MoE aux loss, a mean over each micro-batch's
tokens, is weighted by the micro-batch's share of the rows (`row_weight`), as OpenRLHF does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from learner.batching import TrainBatch, split_evenly
from learner.packing import first_fit_decreasing, regroup

# metrics of a micro-batch that are its share of a mini-batch sum (normalised by the mini-batch's
# counts); the others (clip fractions, ratio means) are the micro-batch's own means
SUMMED_PREFIXES = ("loss/", "policy/entropy")


@dataclass
class MicroBatches:
    """One mini-batch's micro-batches on this rank, as the forwards and backwards run them."""

    micro: list[torch.Tensor]  # row indices of each micro-batch
    live: list[bool]  # False: a filler (a row run again with no loss, so that every rank runs as many)
    capacity: int  # width of the packed rows (with learner.packing)
    manual: bool  # the optimizer step is placed by hand (cut by tokens)

    def select(self, tb: TrainBatch, j: int) -> TrainBatch:
        """Micro-batch j's rows of tb; a filler's with an empty loss mask (its losses are 0, their gradient too)."""
        mb = tb.select(self.micro[j])
        if not self.live[j]:
            mb = dataclasses.replace(mb, loss_mask=torch.zeros_like(mb.loss_mask))
        return mb

    def boundary(self, engine, j: int) -> None:
        """Before micro-batch j's backward on `engine`: the last one steps the optimizer."""
        if self.manual and hasattr(engine, "set_gradient_accumulation_boundary"):
            engine.set_gradient_accumulation_boundary(j == len(self.micro) - 1)

    def row_weight(self, j: int, grad_accum: int) -> float:
        """Micro-batch j's share of the mini-batch's rows, times DeepSpeed's grad_accum divisor: a
        per-micro-batch mean scaled by it sums to the row-weighted mean over the mini-batch."""
        rows = sum(len(m) for m, live in zip(self.micro, self.live) if live)
        return len(self.micro[j]) / rows * grad_accum if self.live[j] else 0.0

    def accumulate(self, sums: dict[str, float], parts: dict[str, float], j: int, grad_accum: int) -> None:
        """Add micro-batch j's metrics to `sums`, so that over the mini-batch each comes to its mean."""
        if not self.live[j]:
            return
        n = len(self.micro) - self.live.count(False) if self.manual else grad_accum
        for k, v in parts.items():
            sums[k] += v / (grad_accum if k.startswith(SUMMED_PREFIXES) else n)


def plan_micro_batches(cfg, lengths: list[int], micro: list[torch.Tensor], device) -> MicroBatches:
    """The micro-batches of one mini-batch (`micro`: its count-cut split, from `batching.mini_batches`)
    by cfg: re-dealt for packing, or cut by cfg.max_tokens_per_micro_batch. Collective when cut by
    tokens on several ranks. `lengths`: every row's length (prompt + completion) in the share."""
    rows = torch.cat(micro)
    longest = max(lengths[i] for i in rows.tolist())
    budget = cfg.max_tokens_per_micro_batch
    if not budget:
        dealt = regroup(lengths, micro) if cfg.packing else micro
        return MicroBatches(dealt, [True] * len(dealt), longest, manual=False)
    cut, live = cut_by_tokens(lengths, rows, budget, cfg.packing, len(micro), device)
    return MicroBatches(cut, live, max(budget, longest) if cfg.packing else longest, manual=True)


def forward_chunks(cfg, lengths: list[int], n_chunks: int, device) -> tuple[list[torch.Tensor], int]:
    """The chunks of the share's rows for the step's no-grad forwards, and the packed rows' capacity:
    `n_chunks` by count (re-dealt for packing), or cut by cfg.max_tokens_per_forward (0: the
    micro-batch budget) into at least n_chunks. A filler chunk recomputes a row: harmless here."""
    chunks = split_evenly(torch.arange(len(lengths)), n_chunks)
    longest = max(lengths)
    budget = cfg.max_tokens_per_forward or cfg.max_tokens_per_micro_batch
    if not budget:
        return (regroup(lengths, chunks) if cfg.packing else chunks), longest
    cut, _ = cut_by_tokens(lengths, torch.arange(len(lengths)), budget, cfg.packing, n_chunks, device)
    return cut, max(budget, longest) if cfg.packing else longest


def cut_by_tokens(lengths: list[int], rows: torch.Tensor, budget: int, packing: bool, min_count: int,
                  device) -> tuple[list[torch.Tensor], list[bool]]:
    """`rows` (indices into `lengths`) cut into micro-batches within `budget` (module docstring), as
    many as the rank that needs most, and at least `min_count`. -> (index tensors, live flags)."""
    sub = [lengths[i] for i in rows.tolist()]
    bins = first_fit_decreasing(sub, budget) if packing else padded_bins(sub, budget)
    count = max(len(bins), min_count)
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([count], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        count = int(t.item())
    live = [True] * len(bins)
    while len(bins) < count:
        widest = max(range(len(bins)), key=lambda b: (len(bins[b]), cost(bins[b], sub, packing)))
        b = bins[widest]
        if len(b) > 1:  # any part of a bin within the budget is within it too
            bins[widest:widest + 1] = [b[: len(b) // 2], b[len(b) // 2:]]
            live[widest:widest + 1] = [True, True]
        else:  # fewer rows than micro-batches: run the shortest row again, with no loss
            bins.append([min(range(len(sub)), key=sub.__getitem__)])
            live.append(False)
    return [rows[torch.tensor(sorted(b), dtype=torch.long)] for b in bins], live


def padded_bins(lengths: list[int], budget: int) -> list[list[int]]:
    """Index bins of `lengths` whose padded frame (rows x longest) stays within `budget`: longest
    first, each bin filled while it fits (a length over the budget alone). Sorted this way, the
    greedy cut is the fewest bins."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    for i in order:
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= budget:
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


def cost(b: list[int], lengths: list[int], packing: bool) -> int:
    """Positions a forward of bin `b` runs on: the packed row's, or the padded frame's."""
    return sum(lengths[i] for i in b) if packing else len(b) * max(lengths[i] for i in b)


def over_budget(lengths: list[int], budget: int) -> int:
    """How many rows are longer than `budget` alone (each gets a micro-batch of its own); 0 when off."""
    return sum(n > budget for n in lengths) if budget else 0
