"""Rollouts for learner tests without a buffer: random scored groups (`make_group`), a buffer stand-in
that serves them (`ListSource`), and one learner step on a plain module (`step_loss_and_grads`)."""

from __future__ import annotations

import numpy as np
import torch

from buffer.client import BufferDone
from buffer.messages import Batch, Rollout, ScoredRollout
from learner.config import LearnerConfig

VOCAB_LO, VOCAB_HI = 4, 70  # ordinary character tokens of the tiny tokenizer (ids 0-3 are specials)


def make_group(group_id: int, n: int, rewards, version: int = 0, seed: int = 0, behav_model=None,
               with_ref: bool = False, lease_id: int = 0, truncated=(), completion_len=(2, 9)) -> list[ScoredRollout]:
    """n scored completions of one random prompt, of lengths in [completion_len[0], completion_len[1]).
    behav_logprobs come from `behav_model` when given (so w = pi_old / mu is 1 at the start), else
    are random log-probs. The samples whose index is in `truncated` end with finish_reason `length`,
    the others with `stop`."""
    rng = np.random.default_rng(seed * 100_003 + group_id)
    prompt = rng.integers(VOCAB_LO, VOCAB_HI, size=int(rng.integers(3, 7))).astype(np.int32)
    completions = [rng.integers(VOCAB_LO, VOCAB_HI, size=int(rng.integers(*completion_len))).astype(np.int32)
                   for _ in range(n)]
    if behav_model is not None:
        from learner.modeling import completion_logprobs

        behav = [lp.numpy().astype(np.float32) for lp in completion_logprobs(behav_model, [prompt] * n, completions)]
    else:
        behav = [np.log(rng.uniform(0.05, 0.9, size=len(c))).astype(np.float32) for c in completions]
    out = []
    for i, c in enumerate(completions):
        r = Rollout(group_id=group_id, sample_index=i, lease_id=lease_id, prompt_ids=prompt, completion_ids=c,
                    behav_logprobs=behav[i], versions=np.full(len(c), version, dtype=np.int32),
                    finish_reason="length" if i in truncated else "stop", worker_id="test")
        ref = (behav[i] - np.float32(0.05)) if with_ref else None
        out.append(ScoredRollout(rollout=r, reward=float(rewards[i]), ref_logprobs=ref))
    return out


def step_loss_and_grads(model, cfg: LearnerConfig, tb, grad_accum: int = 1):
    """Steps 2-3 of a learner step on a copy of `tb`, then one mini-batch of all its rows in
    `grad_accum` micro-batches (dealt by `regroup` with packing, as the learner does) through the
    policy loss and backward, on a plain module (no DeepSpeed). -> (the filled copy, the step's
    metrics, the summed loss, the first micro-batch's loss metrics, every parameter's gradient)."""
    import copy

    from learner.batching import split_evenly
    from learner.packing import regroup
    from learner.trainer import mini_batch_denominators, packed_rows, policy_micro_loss, prepare_step

    b = copy.copy(tb)
    metrics = prepare_step(cfg, model, None, b, step=0, world=1)
    micro = split_evenly(torch.arange(b.size), grad_accum)
    num_tokens, num_seqs = mini_batch_denominators(b.loss_mask, micro, world=1, grad_accum=grad_accum)
    if cfg.packing:
        micro = regroup(b.attention_mask.sum(-1).tolist(), micro)
    model.zero_grad()
    total, first = 0.0, None
    for idx in micro:  # the gradients accumulate, as DeepSpeed's do over a mini-batch
        mb = b.select(idx)
        packed = packed_rows(cfg, mb, int(b.attention_mask.sum(-1).max()))
        loss, parts = policy_micro_loss(cfg, model, mb, packed, num_tokens, num_seqs)
        (loss / grad_accum).backward()
        total, first = total + loss.detach() / grad_accum, first or parts
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return b, metrics, total, first, grads


class ListSource:
    """Stands in for the buffer: step -> the whole step's scored rollouts, split by whole groups."""

    def __init__(self, steps: dict[int, list[ScoredRollout]]):
        self.steps = steps
        self.versions: list[int] = []

    def get_batch(self, step, rank=0, world_size=1, timeout_s=None):
        if step not in self.steps:
            raise BufferDone("no more data")
        groups = sorted({s.rollout.group_id for s in self.steps[step]})
        mine = set(groups[rank::world_size])
        scored = [s for s in self.steps[step] if s.rollout.group_id in mine]
        return Batch(step=step, rank=rank, world_size=world_size, scored=scored, stats={"queued_groups": 3.0})

    def set_version(self, version):
        self.versions.append(version)

    def close(self):
        pass


def run_two_ranks(driver_text: str, folder, *args: str, timeout_s: float = 300.0) -> str:
    """`driver_text` (a Python script) run as two gloo ranks by DeepSpeed's launcher, with `args`
    after the launcher's own; asserts exit 0 and returns the combined output."""
    import subprocess
    import sys
    from pathlib import Path

    from launch.ports import free_port_block
    from tests.helpers.procs import ROOT, subprocess_env

    driver = Path(folder) / "driver.py"
    driver.write_text(driver_text)
    env = subprocess_env()
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
           str(free_port_block(1)), str(driver), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout
