"""The learner's loop: one DeepSpeed rank of the RL trainer, read top to bottom.

Step N turns the version-N weights into version N + 1:
  1. every rank asks the buffer for its share of step N's batch (whole prompt groups);
  2. the proximal log-probs pi_old (and the critic's old values) are computed with no grad;
  3. the behaviour correction w = pi_old / mu, the loss mask (with overlong_filter, truncated
     completions leave it) and the advantages are computed once;
  4. ppo_epochs x num_mini_batches optimizer steps, each over gradient_accumulation_steps micro-batches
     (or as many as max_tokens_per_micro_batch needs: `learner.token_budget`), each followed by the
     EMA's update (`learner.ema`); during critic_warmup_steps only the critic is updated;
  5. the weights are now version N + 1: rank 0 tells the buffer, which admits new leases against
     it, and publishes them (every sync_every steps);
  6. the step's groups go into the ledger (`learner/ledger.py`), metrics are logged, and a
     checkpoint saved every save_every steps (and at the end).

At start (fresh or resumed from the checkpoint at step N), rank 0 publishes the weights and then
sends the buffer the resume handshake: step N and the groups its ledger says steps 0..N-1
trained. The buffer puts itself at that point (everything else it served is issued again), so a
crash anywhere after the checkpoint costs the steps since it, never a group trained twice.

With `packing`, every forward of steps 2 and 4 (policy and critic) runs on the micro-batch's rows
packed without padding (`learner.packing`; a mini-batch's rows are first re-dealt over its
micro-batches so that each packs tightly, which leaves the mini-batch's gradient as it was); the
per-token results come back on the padded (B, T) frame, so losses, advantages and metrics are
the same code either way.

Losses are normalised over the whole mini-batch of all ranks (token or sequence counts are summed
over ranks first), so the gradient does not depend on how the batch was split. The pieces every
learner shares (engines, log-probs, the mean over ranks, the metrics writer, checkpoints) live in
`learner.engine`, `learner.modeling`, `learner.metrics` and `learner.checkpoint`; the offline
trainers (`learner.offline.loop`) use the same ones. What the loop asks of the buffer (its share of a
batch, the handshake, the version, evaluations during training) is in `learner.source`.

With evaluation during training (`eval:` section), rank 0 asks the buffer for the evaluation of
version N before step N (every `eval_every` versions, and the final one), and logs it with step N.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from contextlib import ExitStack, closing

import torch
import torch.distributed as dist

from buffer.client import BufferClient
from common.ready import mark_ready
from learner.advantages import advantages_and_returns, stop_properly_penalty, whiten
from learner.batching import (
    TrainBatch,
    buffer_stats,
    mini_batches,
    score_stats,
    staleness_stats,
    to_train_batch,
)
from learner.checkpoint import restore_latest, save_checkpoint
from learner.config import LearnerConfig
from learner.ema import PolicyEMA
from learner.engine import (
    all_reduce_sum,
    build_critic_engine,
    build_policy_engine,
    grad_norm,
    iter_publish_params,
    process_group,
    stopped,
)
from learner.kl_control import KLController, kl_seq_mean
from learner.ledger import Ledger
from learner.lora import adapter_disabled, adapter_spec, is_lora
from learner.losses import aggregate, behaviour_correction, gspo_loss, kl_penalty, policy_loss, value_loss
from learner.metrics import MetricsWriter, reduce_across_ranks
from learner.modeling import masked_mean, next_token_stats
from learner.moe import RouterAuxLoss, Routers
from learner.packing import PackedRows
from learner.sequence_parallel import SequenceParallel
from learner.source import due, evaluate, fetch_batch, handshake, step_group_ids, tell_version
from learner.token_budget import forward_chunks, over_budget, plan_micro_batches
from learner.vision import pad_token_id, policy_pixels

log = logging.getLogger("conveyor.learner")


def run(cfg: LearnerConfig, stop: threading.Event | None = None, weight_sync=None) -> int:
    """The learner rank (`python -m launch.learner`): `train` against the configured buffer; the exit code."""
    train(cfg, weight_sync=weight_sync, stop=stop)
    return 0


def train(cfg: LearnerConfig, source=None, weight_sync=None, stop: threading.Event | None = None) -> dict[str, float]:
    """Train until `total_steps`, until the buffer is done or until `stop` is set (on any rank: the
    ranks agree on it between steps); returns the last step's metrics.

    `source` answers `get_batch(step, rank, world_size, timeout_s=...)` and `set_version(v)`;
    default: a `BufferClient` at the configured buffer. `weight_sync`: the run's
    `WeightSyncConfig` (bucket size, backend, join timeout, ...) for the sender on rank 0.
    """
    with process_group(cfg) as (rank, world, device):
        return train_rank(cfg, source, rank, world, device, weight_sync, stop)


def train_rank(cfg: LearnerConfig, source, rank: int, world: int, device: torch.device,
               weight_sync=None, stop: threading.Event | None = None) -> dict[str, float]:
    """The loop itself, on a rank of an initialised process group. However it ends, what it opened
    (the buffer client, and on rank 0 the ledger, the metrics writer and the weight sender) is closed."""
    torch.manual_seed(cfg.seed)
    # ranks sharing each sequence (`learner.sequence_parallel`); a group trains one data-parallel share
    sp = SequenceParallel.create(cfg.sequence_parallel, rank, world) if cfg.sequence_parallel > 1 else None
    policy = build_policy_engine(cfg)
    if sp is not None:
        sp.check_model(policy.module.config)
    aux = RouterAuxLoss(policy, cfg.aux_loss_coef, cfg.model_path) if cfg.aux_loss_coef else None
    routers = Routers.attach(policy, cfg.routing_replay)  # (None for a dense policy)
    critic = build_critic_engine(cfg) if cfg.advantage_estimator == "gae" else None
    pad_id = pad_token_id(policy.module.config)
    pixels = policy_pixels(cfg.model_path, packing=cfg.packing, sequence_parallel=cfg.sequence_parallel,
                           critic=critic is not None)  # (None for a text policy)

    step, ckpt = 0, None
    if cfg.resume:
        step, ckpt = restore_latest(cfg.run_dir, policy, critic, "run.learner_ranks", "learner.zero_stage")
    if ckpt is not None and rank == 0:
        log.info(f"resumed from {ckpt} at step {step}")
    kl_ctl = KLController.for_run(cfg, ckpt)  # (an adaptive coefficient goes on from where it was)
    ema = PolicyEMA(policy, cfg.ema_beta) if cfg.ema_beta else None  # from the weights the run starts with
    if ema is not None and ckpt is not None:
        ema.load(ckpt)
    start_step = saved_step = step

    with ExitStack() as opened:
        if source is None:
            # one request may wait a minute for an answer; a batch may take batch_timeout_s to be ready
            source = opened.enter_context(closing(BufferClient(
                cfg.buffer_host or "127.0.0.1", cfg.buffer_port or 5555, timeout_s=min(60.0, cfg.batch_timeout_s))))
        ledger = writer = sender = None
        if rank == 0:
            ledger = opened.enter_context(closing(Ledger(cfg.run_dir)))
            ledger.start(step)  # keeps steps 0..step-1: a crashed lineage's later steps are cut off
            writer = opened.enter_context(closing(MetricsWriter.for_run(cfg.run_dir, cfg)))
            if cfg.weight_sync_port:
                sender = opened.enter_context(closing(weight_sender(cfg, weight_sync)))
        if step > 0 and cfg.weight_sync_port:
            publish(sender, policy, step, rank)  # generators need the resumed weights before new leases
        if rank == 0:
            handshake(source, step, ledger)
            print(f"learner ready: {world} rank(s), ZeRO-{cfg.zero_stage}, {cfg.dtype}, {cfg.advantage_estimator}, "
                  f"steps {step}..{cfg.total_steps - 1}", flush=True)
            mark_ready("learner", world=world, step=step)
        if world > 1:
            dist.barrier()  # no rank asks for a batch before the buffer knows where the lineage stands

        last: dict[str, float] = {}
        while step < cfg.total_steps and not stopped(stop, world, device):
            # (the policy of version `step` is what the generators hold now: the round is run with it)
            evaluated = evaluate(source, step, cfg) if rank == 0 and due(cfg, step) else {}
            t0 = time.monotonic()
            batch = fetch_batch(source, step, rank, world, cfg, device, ledger, sp)
            if batch is None:
                if rank == 0:
                    log.info(f"buffer is done at step {step}")
                break
            t_wait = time.monotonic() - t0

            tb = to_train_batch(batch.scored, pad_id, pixels).to(device)
            t1 = time.monotonic()
            if cfg.routing_replay != "off" and tb.routes is None:
                raise ValueError(f"learner.routing_replay={cfg.routing_replay!r}, but step {step}'s rollouts carry no "
                                 "routes: the generators must record them (generator.record_routes)")
            metrics = train_step(kl_ctl.step_config(cfg), policy, critic, tb, step, world, ema, aux, sp)
            metrics.update(routers.metrics() if routers else {})
            metrics.update(kl_ctl.after_step(cfg, metrics, world, device))  # before a checkpoint keeps it
            t_train = time.monotonic() - t1
            trained_step, step = step, step + 1  # the weights are now version `step`

            groups = step_group_ids(batch, world, device)
            if rank == 0:
                ledger.append(trained_step, groups)
                # before the publish: a generator holding version `step` must find the buffer there already
                tell_version(source, step)
            t2, synced = time.monotonic(), {}
            if cfg.weight_sync_port and step % cfg.sync_every == 0:
                synced = publish(sender, policy, step, rank)
            t_publish = time.monotonic() - t2

            t3 = time.monotonic()
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint(cfg, step, policy, critic, ledger, ema=ema, extra=kl_ctl.state())
                saved_step = step
            t_save = time.monotonic() - t3

            metrics.update(staleness_stats(batch))
            metrics.update(score_stats(batch))
            metrics.update({"time/wait_for_batch": t_wait, "time/train_step": t_train,
                            "time/publish": t_publish, "time/save": t_save})
            metrics = reduce_across_ranks(metrics, device, copies=sp.size if sp else 1)
            metrics["perf/tokens_per_s"] = metrics["perf/tokens"] / max(metrics["time/train_step"], 1e-9)
            if rank == 0:
                if synced.get("bytes"):
                    metrics["sync/bytes"] = float(synced["bytes"])  # (a LoRA policy sends its adapter only)
                    # generators the round reached, and those of them served by the same-host slot
                    metrics["sync/members"] = float(len(synced.get("ok", [])))
                    metrics["sync/same_host"] = float(synced.get("same_host", 0))
                # the buffer's own numbers are rank 0's share's (their keys may differ between ranks)
                for k, v in buffer_stats(batch).items():
                    metrics.setdefault(k, v)
                metrics.update(evaluated)
                writer.log(trained_step, metrics)
                log.info(f"step {trained_step}: loss {metrics.get('loss/policy', 0.0):.4f} "
                    f"reward {metrics['reward/mean']:.3f} staleness {metrics.get('buffer/staleness_mean', 0):.2f} "
                    f"wait {t_wait:.2f}s train {t_train:.2f}s")
            last = metrics

        if rank == 0 and step == cfg.total_steps and step > start_step and due(cfg, step):
            writer.log(step, evaluate(source, step, cfg))  # the final policy's
        if step > start_step and saved_step != step:
            checkpoint(cfg, step, policy, critic, ledger, final=True, ema=ema, extra=kl_ctl.state())
    return last


# ------------------------------------------------------------------------------------------------
# one step


def train_step(cfg: LearnerConfig, policy, critic, tb: TrainBatch, step: int, world: int,
               ema: PolicyEMA | None = None, aux: RouterAuxLoss | None = None,
               sp: SequenceParallel | None = None) -> dict[str, float]:
    """Steps 2-4 of the loop on this rank's share `tb`; returns metrics (this rank's; the loop reduces).
    `ema`: updated after each optimizer step of the policy; `aux`: the MoE router loss to add; `sp`:
    this rank's sequence-parallel group (which holds the same share)."""
    grad_accum = cfg.gradient_accumulation_steps
    metrics = prepare_step(cfg, policy, critic, tb, step, world, sp)
    train_policy = step >= cfg.critic_warmup_steps  # during the critic's warm-up the policy stays as it is

    # 4. the updates
    sums: dict[str, float] = defaultdict(float)
    grad_norms, critic_grad_norms, n_micro = [], [], []
    lengths = tb.attention_mask.sum(-1).tolist()
    for epoch in range(cfg.ppo_epochs):
        for micro in mini_batches(tb.size, cfg.num_mini_batches, grad_accum, seed=shuffle_seed(cfg, step, epoch)):
            num_tokens, num_seqs = mini_batch_denominators(tb.loss_mask, micro, world, grad_accum)
            # the same rows, dealt to pack without gaps or cut by the token budget: the gradient is the same
            plan = plan_micro_batches(cfg, lengths, micro, tb.input_ids.device)
            n_micro.append(len(plan.micro))
            for j in range(len(plan.micro)):
                mb = plan.select(tb, j)
                packed = packed_rows(cfg, mb, plan.capacity)  # shared by the policy and the critic
                parts = {}
                if train_policy:
                    plan.boundary(policy, j)
                    loss, parts = policy_micro_loss(cfg, policy, mb, packed, num_tokens, num_seqs, sp)
                    if aux is not None:
                        loss = aux.add(loss, parts, plan.row_weight(j, grad_accum))
                    policy.backward(loss)
                    policy.step()  # DeepSpeed applies the update at the last micro-batch of the mini-batch
                if critic is not None:
                    plan.boundary(critic, j)
                    v_loss, vm = value_loss(critic_values(critic, mb, packed, sp), mb.old_values, mb.returns,
                                            mb.loss_mask, cfg.value_clip_eps, cfg.loss_agg, num_tokens, num_seqs)
                    critic.backward(v_loss)
                    critic.step()
                    parts.update({"loss/value": v_loss.item(), **{f"critic/{k}": v for k, v in vm.items()}})
                plan.accumulate(sums, parts, j, grad_accum)
            if train_policy:
                grad_norms.append(grad_norm(policy))
                if ema is not None:
                    ema.update(policy)
            if critic is not None:
                critic_grad_norms.append(grad_norm(critic))

    updates = cfg.updates_per_step
    metrics.update({k: v / updates for k, v in sums.items()})
    metrics.setdefault("loss/kl", 0.0)
    metrics["policy/frozen"] = float(not train_policy)
    metrics["perf/micro_batches"] = sum(n_micro) / len(n_micro)
    metrics["perf/over_budget_samples"] = n_over = float(over_budget(lengths, cfg.max_tokens_per_micro_batch))
    if n_over:
        log.warning(f"step {step}: {n_over:.0f} sample(s) longer than learner.max_tokens_per_micro_batch="
                    f"{cfg.max_tokens_per_micro_batch} (up to {max(lengths)} tokens): each took a micro-batch alone")
    metrics["optim/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
    metrics["optim/lr"] = float(policy.get_lr()[0])
    if critic is not None:
        metrics["optim/critic_grad_norm"] = sum(critic_grad_norms) / len(critic_grad_norms)
    return metrics


def prepare_step(cfg: LearnerConfig, policy, critic, tb: TrainBatch, step: int, world: int,
                 sp: SequenceParallel | None = None) -> dict[str, float]:
    """Steps 2-3: fills tb's pi_old, old values, weights, loss mask, advantages and returns (fixed
    for the whole step); returns the step's batch metrics. `policy` and `critic` may be engines or
    plain modules (no optimizer is touched)."""
    n_chunks = cfg.num_mini_batches * cfg.gradient_accumulation_steps  # every rank runs this many forwards per pass
    lora = is_lora(policy)
    if cfg.kl_coef > 0 and tb.ref_logprobs is None and not lora:
        raise ValueError(f"learner.kl_coef={cfg.kl_coef} needs ref_logprobs, but step {step}'s rollouts "
                         f"carry none: run a reference scorer or set kl_coef=0")
    mask = tb.action_mask  # the completion tokens the policy sampled (a multi-turn episode's are not all)

    # 2. pi_old: the weights at the start of the step, no grad (and the critic's values)
    chunks, longest = forward_chunks(cfg, tb.attention_mask.sum(-1).tolist(), n_chunks, tb.input_ids.device)
    tb.prox_logprobs = forward_in_chunks(lambda mb: next_token_stats(
        policy, mb.input_ids, mb.attention_mask, cfg.temperature, packed_rows(cfg, mb, longest), sp=sp,
        routes=mb.routes, vision=mb.vision)[0], tb, chunks)
    if critic is not None:
        tb.old_values = forward_in_chunks(
            lambda mb: critic_values(critic, mb, packed_rows(cfg, mb, longest), sp), tb, chunks)
    if cfg.kl_coef > 0 and tb.ref_logprobs is None and lora:
        # LoRA: the reference is the frozen base, i.e. this model with its adapter switched off
        with adapter_disabled(policy):
            tb.ref_logprobs = forward_in_chunks(lambda mb: next_token_stats(
                policy, mb.input_ids, mb.attention_mask, cfg.temperature, packed_rows(cfg, mb, longest), sp=sp,
                vision=mb.vision)[0],
                tb, chunks)

    # 3. behaviour correction and advantages, fixed for the whole step
    tb.weights, tb.loss_mask, behav = behaviour_correction(
        tb.prox_logprobs, tb.behav_logprobs, mask, cfg.behav_correction, cfg.behav_tis_cap,
        cfg.behav_low, cfg.behav_high, cfg.behav_mask_level, cfg.behav_gating, cfg.behav_tis_low)
    if cfg.overlong_filter:
        # DAPO: a truncated completion's tokens leave the loss and its denominators; its reward
        # still counts in its group's advantages and in the reward statistics
        tb.loss_mask = tb.loss_mask & ~tb.truncated[:, None]  # (B, T)
    kl_ref = None
    if tb.ref_logprobs is not None:
        kl_ref = kl_penalty(tb.prox_logprobs, tb.ref_logprobs, cfg.kl_estimator) * mask  # (B, T)
    tb.advantages, tb.returns = compute_advantages(cfg, tb, kl_ref, sum_fn=all_reduce_sum if world > 1 else None)
    distill = distill_advantages(cfg, tb, mask, step, world)

    truncated_frac = float(tb.truncated.float().mean())
    return {
        "reward/mean": float(tb.rewards.mean()),
        "reward/std": float(tb.rewards.std()) if tb.size > 1 else 0.0,
        "advantages/mean": float(masked_mean(tb.advantages, mask)),
        "advantages/std": float(masked_mean((tb.advantages - masked_mean(tb.advantages, mask)).square(), mask).sqrt()),
        "policy/kl_to_ref": float(masked_mean(kl_ref, mask)) if kl_ref is not None else 0.0,
        **kl_seq_mean(kl_ref, mask),  # (what an adaptive KL controller measures with kl_in="reward")
        "perf/tokens": float(tb.attention_mask.sum()),
        "perf/samples": float(tb.size),
        "perf/completion_len": float(mask.sum(-1).float().mean()),
        "perf/env_token_frac": 1.0 - float(mask.sum()) / max(tb.num_completion_tokens, 1),  # multi-turn
        "overlong/truncated_frac": truncated_frac,
        "overlong/filtered_frac": truncated_frac if cfg.overlong_filter else 0.0,
        **{f"policy/{k}": v for k, v in behav.items()},
        **distill,
    }


def distill_advantages(cfg: LearnerConfig, tb: TrainBatch, mask: torch.Tensor, step: int,
                       world: int = 1) -> dict[str, float]:
    """On-policy distillation: adds distill_coef x (log teacher - log pi_old) to each sampled token's
    advantage, the negative per-token reverse KL of the student to the teacher (one sample, no
    discount), whose policy gradient lowers KL(pi || teacher) on the student's own samples (on-policy
    distillation, Agarwal et al. 2024, "GKD"; the per-token form as Thinking Machines' "On-Policy
    Distillation", 2025, uses it). Returns its metrics ({} when off)."""
    if not cfg.distill_coef:
        return {}
    if tb.teacher_logprobs is None:
        raise ValueError(f"learner.distill_coef={cfg.distill_coef} needs teacher_logprobs, but step {step}'s "
                         f"rollouts carry none: run a scorer of kind `teacher` (scorer.teacher)")
    gap = (tb.teacher_logprobs - tb.prox_logprobs) * mask  # (B, T): log teacher - log pi_old
    term = gap
    if cfg.distill_baseline == "mean":  # the step's mean over every rank's sampled tokens taken off
        term = whiten(gap, mask, all_reduce_sum if world > 1 else None, std_norm=False)
    tb.advantages = tb.advantages + cfg.distill_coef * term
    return {"distill/reverse_kl": float(masked_mean(-gap, mask)),
            "distill/advantage_mean": float(masked_mean(cfg.distill_coef * term, mask))}


def policy_micro_loss(cfg: LearnerConfig, policy, mb: TrainBatch, packed: PackedRows | None,
                      num_tokens: torch.Tensor, num_seqs: torch.Tensor,
                      sp: SequenceParallel | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's policy loss (PPO + the KL and entropy terms the config asks for), with grad,
    and its metrics. `packed`: run the forward on mb's packed rows (`mb.packed_rows()`)."""
    logprobs, entropy = next_token_stats(policy, mb.input_ids, mb.attention_mask, cfg.temperature, packed,
                                         entropy=cfg.entropy_coef > 0, sp=sp, routes=mb.routes,
                                         vision=mb.vision)  # (b, t) each
    if cfg.policy_loss == "gspo":
        base = mb.behav_logprobs if cfg.gspo_ratio == "behav" else mb.prox_logprobs
        pg_loss, pg = gspo_loss(logprobs, base, mb.advantages, mb.loss_mask, cfg.clip_eps_low, cfg.clip_eps_high,
                                cfg.dual_clip_c, num_seqs)
    else:
        pg_loss, pg = policy_loss(logprobs, mb.prox_logprobs, mb.advantages, mb.loss_mask, mb.weights, cfg.clip_eps_low,
                                  cfg.clip_eps_high, cfg.dual_clip_c, cfg.loss_agg, num_tokens, num_seqs)
    loss = pg_loss
    parts = {f"policy/{k}": v for k, v in pg.items()}
    if cfg.kl_coef > 0 and cfg.kl_in == "loss":
        kl = aggregate(kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_estimator, cfg.kl_unbiased_gradient,
                                  mb.prox_logprobs), mb.loss_mask, cfg.loss_agg, num_tokens, num_seqs)
        loss = loss + cfg.kl_coef * kl
        parts["loss/kl"] = kl.item()
    if entropy is not None:
        ent = aggregate(entropy, mb.loss_mask, cfg.loss_agg, num_tokens, num_seqs)
        loss = loss - cfg.entropy_coef * ent
        parts["policy/entropy"] = ent.item()
    parts.update({"loss/policy": pg_loss.item(), "loss/total": loss.item()})
    return loss, parts


def packed_rows(cfg: LearnerConfig, mb: TrainBatch, capacity: int | None = None) -> PackedRows | None:
    """mb's rows packed without padding into rows of `capacity` (default: mb's longest) when
    `learner.packing` is on (the forwards then run on them)."""
    return mb.packed_rows_or_none(cfg.packing, capacity)


def critic_values(critic, mb: TrainBatch, packed: PackedRows | None,
                  sp: SequenceParallel | None = None) -> torch.Tensor:
    """The critic's value of each state (b, t) on mb's frame (grad flows); `packed`: on packed rows."""
    if sp is not None:
        if packed is None:
            return sp.values(critic, mb.input_ids, None)[:, :-1]
        return packed.unpack(sp.values(critic, packed.input_ids, packed.position_ids))[:, :-1]
    if packed is None:
        return critic(mb.input_ids, mb.attention_mask)[:, :-1]
    return packed.unpack(critic(packed.input_ids, None, packed.position_ids))[:, :-1]  # (R, C) -> (b, l) -> (b, t)


def compute_advantages(cfg: LearnerConfig, tb: TrainBatch, kl_ref: torch.Tensor | None,
                       sum_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (B, T) by `cfg.advantage_estimator` (`learner.advantages`: baseline,
    reward clip, per-token reward, returns or GAE, whitening), from the rewards after the
    stop-properly penalty. With kl_in="reward", each token's reward has kl_coef times its KL to
    the reference (under pi_old) taken off.
    """
    fold = kl_ref is not None and cfg.kl_coef > 0 and cfg.kl_in == "reward"
    rewards = stop_properly_penalty(tb.rewards, tb.truncated, cfg.stop_properly_penalty_coef)  # (B,)
    return advantages_and_returns(
        cfg.advantage_estimator, rewards, tb.group_ids, tb.action_mask, kl_ref if fold else None, cfg.kl_coef,
        tb.old_values, cfg.gamma, cfg.gae_lambda, cfg.adv_eps, cfg.adv_std_norm, cfg.reward_clip_range, sum_fn)


# ------------------------------------------------------------------------------------------------
# helpers


@torch.no_grad()
def forward_in_chunks(fn, tb: TrainBatch, chunks: list[torch.Tensor]) -> torch.Tensor:
    """fn over the share's rows `chunks` (index tensors), reassembled to (B, T) (0 off the completion)."""
    out = torch.zeros(tb.completion_mask.shape, dtype=torch.float32, device=tb.input_ids.device)
    for idx in chunks:
        v = fn(tb.select(idx)).float()  # (b, t) with t <= T (the slice is trimmed)
        out[idx.to(out.device), : v.shape[1]] = v
    return out * tb.completion_mask


def mini_batch_denominators(loss_mask: torch.Tensor, micro: list[torch.Tensor], world: int,
                            grad_accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-micro-batch token and sequence denominators that make the summed gradient the mini-batch mean.

    DeepSpeed divides each micro-batch's loss by grad_accum and averages gradients over ranks, so
    a micro-batch's token sum is divided by (tokens of the mini-batch on all ranks) / (world * grad_accum).
    (A sequence-parallel group's ranks hold the same share: each counts it, as it counts in the
    ranks' mean of the loss; the gradient of each rank's slice is the whole group's, see
    `learner.sequence_parallel`.)
    """
    idx = torch.cat(micro).to(loss_mask.device)
    counts = torch.stack([loss_mask[idx].sum(), loss_mask[idx].any(-1).sum()]).double()  # (2,)
    if world > 1:
        counts = all_reduce_sum(counts)
    counts = counts.clamp_min(1.0) / (world * grad_accum)
    return counts[0].float(), counts[1].float()


def shuffle_seed(cfg: LearnerConfig, step: int, epoch: int) -> int:
    return (cfg.seed * 1_000_003 + step * 1_009 + epoch) % (2**63)


# ------------------------------------------------------------------------------------------------
# the weight-sync service and checkpoints


def publish(sender, policy, version: int, rank: int) -> dict:
    """Rank 0 sends the weights to the weight-sync service (a LoRA policy: only its adapter); under
    ZeRO-3 every rank helps gather. Returns the round's stats on rank 0 (`bytes`, ...), else {}."""
    params = iter_publish_params(policy)
    stats: dict = {}
    if rank == 0:
        stats = sender.publish(version, params, adapter=adapter_spec(policy)) or {}
        if stats.get("error") or stats.get("failed"):
            log.info(f"weight sync of version {version}: error {stats.get('error')!r}, failed {stats.get('failed')}")
    for _ in params:  # other ranks (and rank 0, if the sender stopped early) finish the gathers
        pass
    return stats


def weight_sender(cfg: LearnerConfig, weight_sync=None):
    """Rank 0's sender to the weight-sync service at cfg's address; `weight_sync` (the run's section)
    sets its other knobs. The learner's own address and timeout win over the section's (they may be
    overridden)."""
    from weight_sync.sender import WeightSender

    if weight_sync is None:
        return WeightSender(cfg.weight_sync_host, cfg.weight_sync_port, cfg.weight_sync_timeout_s)
    return WeightSender.from_config(weight_sync, host=cfg.weight_sync_host, port=cfg.weight_sync_port,
                                    timeout_s=cfg.weight_sync_timeout_s)


def checkpoint(cfg: LearnerConfig, step: int, policy, critic, ledger: Ledger | None, final: bool = False,
               ema: PolicyEMA | None = None, extra: dict | None = None) -> None:
    """Save step `step` (collective); the ledger lines the checkpoint relies on reach the disk first.
    A LoRA policy's checkpoint holds the merged HF model too when `lora_save_merged` or `final`;
    with `ema`, the HF model is the EMA and the folder holds its state (`learner.ema`); `extra`
    goes into trainer_state.json (the KL coefficient)."""
    if ledger is not None:
        ledger.sync()
    save_checkpoint(cfg.run_dir, step, policy, critic, cfg.model_path, extra=extra, keep=cfg.keep_checkpoints,
                    merged=cfg.lora_save_merged or final,
                    also=(lambda out: ema.save(out, policy)) if ema is not None else None)
