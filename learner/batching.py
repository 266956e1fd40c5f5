"""From the buffer's `Batch` of scored rollouts to padded tensors, and the split into micro-batches.

Positions: a row is prompt + completion, right-padded to L. Per-token tensors live on the (B, T)
frame of next-token predictions, T = L - 1: entry t is about token t + 1, predicted by the logits
at position t (as `learner.modeling.pad_sequences` builds `completion_mask`). With
`learner.packing` on, a micro-batch's forwards run on packed rows (`TrainBatch.packed_rows`), and
their outputs come back on this frame: nothing downstream sees the packing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from buffer.messages import Batch, ScoredRollout
from buffer.rules import EXTRA_LOG_PREFIX, TASK
from learner.modeling import pad_sequences
from learner.packing import PackedRows, pack_rows
from learner.vision import Pixels, VisionRows


@dataclass
class TrainBatch:
    """One rank's share of a step, as tensors; the trainer fills the optional fields during the step."""

    input_ids: torch.Tensor  # (B, L) long, prompt + completion, right-padded
    attention_mask: torch.Tensor  # (B, L) long
    completion_mask: torch.Tensor  # (B, T) bool, T = L - 1
    action_mask: torch.Tensor  # (B, T) bool, the completion tokens the policy sampled (not an environment's)
    behav_logprobs: torch.Tensor  # (B, T) float32, log mu (0 off the completion)
    versions: torch.Tensor  # (B, T) long, policy version of each completion token (-1 elsewhere)
    rewards: torch.Tensor  # (B,) float32
    group_ids: torch.Tensor  # (B,) long
    truncated: torch.Tensor  # (B,) bool, the generator stopped at its length limit (finish_reason "length")
    ref_logprobs: torch.Tensor | None = None  # (B, T) float32 under the reference, when scored
    teacher_logprobs: torch.Tensor | None = None  # (B, T) float32 under a teacher, when scored
    # (B, L, layers, k) int16: the experts the engine routed each token to (rollouts that carry
    # routes, for routing replay: learner.moe), -1 where unknown (each row's last token, padding)
    routes: torch.Tensor | None = None
    # a vision-language policy's rows: each row's images as pixels (learner.vision), None without images
    vision: VisionRows | None = None
    # ---- filled in by the trainer -------------------------------------------------------------
    prox_logprobs: torch.Tensor | None = None  # (B, T) log pi_old, no grad
    old_values: torch.Tensor | None = None  # (B, T) critic at the start of the step
    weights: torch.Tensor | None = None  # (B, T) corrected w = pi_old / mu
    loss_mask: torch.Tensor | None = None  # (B, T) bool, completion tokens the loss counts
    advantages: torch.Tensor | None = None  # (B, T)
    returns: torch.Tensor | None = None  # (B, T)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def select(self, idx: torch.Tensor) -> "TrainBatch":
        """Rows `idx`, trimmed to the longest of them (so a micro-batch of short rows stays short)."""
        L = int(self.attention_mask[idx].sum(-1).max())
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                out[f.name] = None
            elif f.name == "vision":
                out[f.name] = v.select(idx)
            elif v.dim() == 1:
                out[f.name] = v[idx]
            elif f.name in ("input_ids", "attention_mask", "routes"):
                out[f.name] = v[idx, :L]
            else:
                out[f.name] = v[idx, : L - 1]
        return TrainBatch(**out)

    def packed_rows(self, capacity: int | None = None) -> PackedRows:
        """The rows packed without padding into rows of `capacity` (default: the longest), for the
        forwards (`learner.packing`)."""
        return pack_rows(self.input_ids, self.attention_mask, capacity)

    def packed_rows_or_none(self, packing: bool, capacity: int | None = None) -> PackedRows | None:
        """`packed_rows` when `packing` is on and the rows hold no images (those are never packed)."""
        return self.packed_rows(capacity) if packing and self.vision is None else None

    def to(self, device: torch.device | str) -> "TrainBatch":
        return TrainBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                             for f in dataclasses.fields(self)})


def _scatter(rows: list[np.ndarray], mask: torch.Tensor, fill: float, dtype: torch.dtype) -> torch.Tensor:
    """Place each row's per-completion-token values at its completion positions. -> (B, T)."""
    out = torch.full(mask.shape, fill, dtype=dtype)
    if rows:
        # completion positions of a row are contiguous and in order, so row-major order matches
        out[mask] = torch.from_numpy(np.concatenate([np.asarray(r, dtype=np.float64) for r in rows])).to(dtype)
    return out


def to_train_batch(scored: list[ScoredRollout], pad_id: int = 0, pixels: Pixels | None = None) -> TrainBatch:
    """Scored rollouts -> padded tensors. Rejects empty completions and prompts (nothing to train on).
    `pixels` (a vision-language policy's image processor): the rollouts' images become `vision`."""
    if not scored:
        raise ValueError("no rollouts to train on")
    prompts, completions = [], []
    for i, s in enumerate(scored):
        r = s.rollout
        if len(r.prompt_ids) == 0 or len(r.completion_ids) == 0:
            raise ValueError(f"rollout {i} (group {r.group_id}, sample {r.sample_index}) has an empty "
                             f"prompt ({len(r.prompt_ids)} ids) or completion ({len(r.completion_ids)} ids)")
        prompts.append(r.prompt_ids)
        completions.append(r.completion_ids)
    input_ids, attention_mask, completion_mask = pad_sequences(prompts, completions, pad_id)
    has_ref = [s.ref_logprobs is not None for s in scored]
    has_teacher = [s.teacher_logprobs is not None for s in scored]
    for name, has in (("ref_logprobs", has_ref), ("teacher_logprobs", has_teacher)):
        if any(has) and not all(has):
            raise ValueError(f"{sum(has)} of {len(scored)} rollouts carry {name}: all or none must")
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        action_mask=completion_mask if all(s.rollout.action_mask is None for s in scored) else _scatter(
            [np.ones(len(s.rollout.completion_ids)) if s.rollout.action_mask is None else s.rollout.action_mask
             for s in scored], completion_mask, 0, torch.float32) > 0,
        behav_logprobs=_scatter([s.rollout.behav_logprobs for s in scored], completion_mask, 0.0, torch.float32),
        versions=_scatter([s.rollout.versions for s in scored], completion_mask, -1, torch.long),
        rewards=torch.tensor([float(s.reward) for s in scored], dtype=torch.float32),
        group_ids=torch.tensor([int(s.rollout.group_id) for s in scored], dtype=torch.long),
        truncated=torch.tensor([s.rollout.finish_reason == "length" for s in scored], dtype=torch.bool),
        ref_logprobs=_scatter([s.ref_logprobs for s in scored], completion_mask, 0.0, torch.float32)
        if all(has_ref) else None,
        teacher_logprobs=_scatter([s.teacher_logprobs for s in scored], completion_mask, 0.0, torch.float32)
        if all(has_teacher) else None,
        routes=_routes(scored, input_ids.shape[1]),
        vision=_vision(scored, input_ids, pixels),
    )


def _vision(scored: list[ScoredRollout], input_ids: torch.Tensor, pixels: Pixels | None) -> VisionRows | None:
    """The rows' images as pixels (`learner.vision.VisionRows`), or None when no rollout has any."""
    images = [s.rollout.images for s in scored]
    if not any(images):
        return None
    if pixels is None:
        r = scored[next(i for i, im in enumerate(images) if im)].rollout
        raise ValueError(f"group {r.group_id} sample {r.sample_index} carries images, but the policy is not a "
                         f"vision-language model (learner.model_path has no vision tower)")
    names = [f"group {s.rollout.group_id} sample {s.rollout.sample_index}" for s in scored]
    return VisionRows.of(pixels, images, input_ids, names)


def _routes(scored: list[ScoredRollout], length: int) -> torch.Tensor | None:
    """(B, L, layers, k) int16 of the rollouts' routes, -1 where none; None when no rollout has any."""
    has = [s.rollout.routes is not None for s in scored]
    if not any(has):
        return None
    if not all(has):
        r = scored[has.index(False)].rollout
        raise ValueError(f"{sum(has)} of {len(scored)} rollouts carry routes, not group {r.group_id} sample "
                         f"{r.sample_index} (from {r.worker_id or 'a generator'}): all or none must")
    arrays = [s.rollout.route_array() for s in scored]
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) > 1:
        raise ValueError(f"the rollouts' routes differ in layers x experts per token: {sorted(shapes)}")
    out = torch.full((len(scored), length, *arrays[0].shape[1:]), -1, dtype=torch.int16)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = torch.from_numpy(a.astype(np.int16))
    return out


def split_evenly(idx: torch.Tensor, n: int) -> list[torch.Tensor]:
    """`idx` into `n` consecutive chunks whose sizes differ by at most one (none empty)."""
    if len(idx) < n:
        raise ValueError(f"cannot split {len(idx)} samples into {n} non-empty chunks")
    return [c for c in torch.tensor_split(idx, n)]


def mini_batches(size: int, num_mini_batches: int, grad_accum: int, seed: int) -> list[list[torch.Tensor]]:
    """Shuffled row indices: `num_mini_batches` lists of `grad_accum` micro-batch index tensors.

    Every rank gets the same counts whatever its share's size, because every ZeRO stage needs all
    ranks to run the same number of forward/backward passes. `seed` fixes the shuffle (the trainer
    derives it from the run seed, the step and the epoch, so a resumed run shuffles the same).
    """
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(size, generator=g)
    return [split_evenly(mb, grad_accum) for mb in split_evenly(perm, num_mini_batches)]


def staleness_stats(batch: Batch) -> dict[str, float]:
    """Staleness of one share: step - the oldest token version of each rollout, as min/mean/max."""
    stale = [batch.step - s.rollout.min_version for s in batch.scored if len(s.rollout.versions)] or [0]
    return {
        "buffer/staleness_min": float(min(stale)),
        "buffer/staleness_mean": float(sum(stale) / len(stale)),
        "buffer/staleness_max": float(max(stale)),
    }


def score_stats(batch: Batch) -> dict[str, float]:
    """Mean of each reward component over one share, as `reward/<name>` (`reward/overlong`, ...).
    Every scorer computes the same components, so every rank has the same keys. Also the mean of
    each extra log an OpenRLHF-style reward gave (`metadata["extra/<name>"]`, buffer/rules.py) over
    the samples that carry it, as `reward/extra/<name>`: those keys may differ between ranks
    (learner/metrics.py `VARYING`)."""
    n = max(len(batch.scored), 1)
    names = sorted({k for s in batch.scored for k in s.scores})
    out = {f"reward/{k}": sum(s.scores.get(k, 0.0) for s in batch.scored) / n for k in names}
    extra: dict[str, list[float]] = {}
    for s in batch.scored:
        for k, v in s.metadata.items():
            if k.startswith(EXTRA_LOG_PREFIX) and isinstance(v, (int, float)) and not isinstance(v, bool):
                extra.setdefault(k, []).append(float(v))
    return out | {f"reward/{k}": sum(v) / len(v) for k, v in sorted(extra.items())} | task_stats(batch.scored)


def task_stats(scored) -> dict[str, float]:
    """Per task (`metadata["task"]`, actors/tasks.py), over one share's samples of it: the mean reward,
    the pass rate (the share with a reward above 0), the mean completion length and the task's share
    of the samples, as `task/<name>/...` (keys that differ between ranks: learner/metrics.py `VARYING`)."""
    by: dict[str, list] = {}
    for s in scored:
        task = s.metadata.get(TASK)
        if isinstance(task, str):
            by.setdefault(task, []).append(s)
    out = {}
    for task, ss in sorted(by.items()):
        n = len(ss)
        out.update({f"task/{task}/reward_mean": sum(s.reward for s in ss) / n,
                    f"task/{task}/pass_rate": sum(s.reward > 0 for s in ss) / n,
                    f"task/{task}/completion_len": sum(len(s.rollout.completion_ids) for s in ss) / n,
                    f"task/{task}/share": n / len(scored)})
    return out


def buffer_stats(batch: Batch) -> dict[str, float]:
    """The buffer's own numbers about this share (`Batch.stats`), under `buffer/`."""
    return {k if "/" in k else f"buffer/{k}": float(v) for k, v in batch.stats.items()}
