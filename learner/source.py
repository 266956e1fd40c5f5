"""The learner's side of the buffer: its share of each step's batch, the resume handshake, the
version it is at, and the evaluations it asks for.

Batches. Every rank asks for its share of step N (`ask_for_share`); the ranks then agree on the
worst outcome (an all-reduce MIN of `Outcome`), so one rank's trouble (no answer in time, a share
too small for the forwards every rank runs) stops them all together, with the reason.

Evaluation during training. The buffer runs the round (buffer/eval.py: the run's generators sample
the evaluation prompts with the weights of that version, its scorers score them, nothing is trained
on); the learner only decides when, and waits. Rank 0 asks for version v once v is published and
before it trains step v (so the generators hold exactly v, and no newer weights exist until the
round is done), and for the final version after the last step. The report's `eval/*` values are
logged with step v. A round that does not finish within `learner.eval_timeout_s` is given up: the
run goes on without it, says why, and counts `eval/timeouts`. Training is what the run is for;
evaluation must not stop it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from enum import IntEnum

import torch
import torch.distributed as dist

from buffer.client import BufferClient, BufferDone, BufferError, ResumeNeeded
from buffer.messages import Batch, EvalReport, EvalRequest, Wait
from learner.config import LearnerConfig
from learner.ledger import Ledger

log = logging.getLogger("conveyor.learner")


# ---- batches -----------------------------------------------------------------------------------


class Outcome(IntEnum):
    """What one rank got when it asked for its share; ranks agree on the lowest (an all-reduce MIN),
    so one rank's trouble stops them all, together."""

    FAILED = 0  # no answer in time, or the buffer refused
    DONE = 1  # the buffer has no more data
    SHORT = 2  # fewer rollouts than the forwards every rank runs per pass
    OK = 3


@dataclasses.dataclass
class Share:
    """One rank's answer for one step, before the ranks agree."""

    outcome: Outcome
    batch: Batch | None = None
    why: str = ""  # FAILED: the error


def fetch_batch(source, step: int, rank: int, world: int, cfg: LearnerConfig, device: torch.device,
                ledger: Ledger | None = None, sp=None) -> Batch | None:
    """This rank's share of step `step`, or None when the buffer is done. All ranks agree on which
    (collective); a failure or a share too small for the step on any rank fails every rank.

    `sp` (a `learner.sequence_parallel.SequenceParallel`): the group's leader asks for the group's
    share (one of world / size) and sends it to the others."""
    if sp is None:
        share = ask_for_share(source, step, rank, world, cfg, ledger)
    elif sp.leads:
        share = ask_for_share(source, step, sp.share, sp.shares, cfg, ledger)
    else:
        share = Share(Outcome.OK)  # (what the leader got decides, through the agreement)
    flag = torch.tensor([int(share.outcome)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    agreed = Outcome(int(flag.item()))
    if agreed is Outcome.FAILED:
        raise RuntimeError(f"rank {rank} got no batch for step {step} (batch_timeout_s={cfg.batch_timeout_s}): "
                           + (share.why or "another rank failed to get its share"))
    if agreed is Outcome.SHORT:
        raise RuntimeError(
            f"a rank's share of step {step} has fewer rollouts than num_mini_batches x gradient_accumulation_steps "
            f"= {cfg.num_mini_batches * cfg.gradient_accumulation_steps} (this rank: "
            f"{len(share.batch.scored) if share.batch else 0}); raise buffer.prompts_per_step or lower those")
    if agreed is not Outcome.OK:
        return None
    return share.batch if sp is None else sp.share_batch(share.batch, device)


def ask_for_share(source, step: int, rank: int, world: int, cfg: LearnerConfig, ledger: Ledger | None) -> Share:
    """This rank's own answer (no collective).

    While it waits, the buffer's diagnosis (admission, generators, scorers) is logged every
    `wait_log_s`; after `batch_timeout_s` it is FAILED with it. A buffer that restarted from disk
    asks for the resume handshake again: rank 0 gives it (the lineage is the one in memory).
    """
    def on_wait(waited_s: float, reason: str) -> None:
        log.info(f"rank {rank} waiting {waited_s:.0f}s for step {step}'s batch: {reason}")

    deadline = time.monotonic() + cfg.batch_timeout_s
    kw = {"on_wait": on_wait, "report_every_s": cfg.wait_log_s} if isinstance(source, BufferClient) else {}
    try:
        while True:
            try:
                batch = source.get_batch(step, rank, world, timeout_s=max(1.0, deadline - time.monotonic()), **kw)
                break
            except ResumeNeeded:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the buffer kept asking for the resume handshake for "
                                       f"{cfg.batch_timeout_s:.0f}s") from None
                if rank == 0:
                    log.info(f"the buffer restarted from disk: resume handshake again at step {step}")
                    handshake(source, step, ledger)
                else:
                    time.sleep(0.5)
    except BufferDone:
        return Share(Outcome.DONE)
    except (TimeoutError, BufferError, OSError) as e:
        return Share(Outcome.FAILED, why=f"{type(e).__name__}: {e}")
    enough = len(batch.scored) >= cfg.num_mini_batches * cfg.gradient_accumulation_steps
    return Share(Outcome.OK if enough else Outcome.SHORT, batch)


def step_group_ids(batch, world: int, device: torch.device) -> list[int]:
    """The prompt groups of the whole step (every rank's share), for the ledger; collective."""
    mine = sorted({s.rollout.group_id for s in batch.scored})
    if world == 1:
        return mine
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([len(mine)], dtype=torch.int64, device=device))
    width = int(max(c.item() for c in counts))
    padded = torch.full((width,), -1, dtype=torch.int64, device=device)
    padded[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)  # (world, width), -1 past each share's end
    return sorted({int(g) for t in gathered for g in t.tolist() if g >= 0})  # (a sequence-parallel group's once)


def handshake(source, step: int, ledger: Ledger | None) -> None:
    """Tell the buffer where this lineage stands: step `step`, the groups of steps 0..step-1."""
    resume = getattr(source, "resume", None)
    if resume is None:  # a stand-in source (tests) keeps no state across restarts: the version will do
        tell_version(source, step)
        return
    trained = ledger.trained() if ledger is not None else []
    resume(step, trained)
    if step:
        log.info(f"buffer told: resuming at step {step} with {len(trained)} groups trained")


def tell_version(source, version: int) -> None:
    try:
        source.set_version(version)
    except (BufferError, TimeoutError) as e:
        log.info(f"could not tell the buffer version {version}: {e}")


# ---- evaluation during training ------------------------------------------------------------------


def due(cfg: LearnerConfig, version: int) -> bool:
    """Whether the policy of `version` is evaluated (every `eval_every` versions, 0 included)."""
    return bool(cfg.eval_every) and version % cfg.eval_every == 0


def evaluate(source, version: int, cfg: LearnerConfig) -> dict[str, float]:
    """The buffer's report for `version` ({} where the source is not a buffer), waiting for the
    round with progress lines every `wait_log_s`; on timeout {"eval/timeouts": 1.0}."""
    if not isinstance(source, BufferClient):
        return {}
    t0 = time.monotonic()
    next_report = t0 + cfg.wait_log_s
    while True:
        try:
            reply = source.request(EvalRequest(version))
        except (BufferError, TimeoutError) as e:
            log.info(f"evaluation of version {version} skipped: {e}")
            return {"eval/timeouts": 1.0}
        now = time.monotonic()
        if isinstance(reply, EvalReport):
            log.info(f"evaluation of version {version}: pass@1 {reply.values.get('eval/pass@1', 0):.3f} "
                           f"reward {reply.values.get('eval/reward_mean', 0):.3f} ({now - t0:.1f}s)")
            return {**reply.values, "eval/wait_s": now - t0}
        if not isinstance(reply, Wait):
            raise BufferError(f"unexpected reply to eval_request: {type(reply).__name__}")
        if now - t0 > cfg.eval_timeout_s:
            log.info(f"evaluation of version {version} given up after {cfg.eval_timeout_s:.0f}s "
                           f"(learner.eval_timeout_s): {reply.reason}; training goes on")
            return {"eval/timeouts": 1.0}
        if now >= next_report:
            log.info(f"waiting {now - t0:.0f}s for the evaluation of version {version}: {reply.reason}")
            next_report = now + cfg.wait_log_s
        time.sleep(reply.retry_after_s)
