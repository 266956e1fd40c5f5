"""The loop the offline trainers share (SFT, DPO, reward model): data in, DeepSpeed steps, metrics, saves.

    for epoch:                                   a seeded permutation of the training examples
        for each global batch of batch_size:     dropped when incomplete
            this rank's slice, in micro-batches  loss_fn -> engine.backward -> engine.step
            (DeepSpeed applies the update after the last micro-batch of the step)
            log every log_every, evaluate every eval_every, checkpoint every save_every
    evaluate, save the final model (HF format) to save_path

With `lora_rank > 0` the model trains LoRA adapters only (`learner/lora.py`); save_path then holds
the merged model (HF format) and the adapter in peft's format under `save_path/adapter/`.

A trainer (`sft.py`, `dpo.py`, `rm.py`) gives `run_trainer` its `make_trainer`, which returns a
`Trainer`: `loss_fn(idx, denom)` and `eval_fn(idx, weights)` over indices into its own example
lists, and `weight_fn(idx)` (what a step's loss is averaged over: response tokens for SFT, pairs
for DPO and RM). The loss of one micro-batch is its sum divided by `denom` = (the global
batch's weight) / (ranks x micro-batches per step): DeepSpeed divides by the micro-batch count and
averages over ranks, so the gradient is exactly that of the global batch's mean, however it is split.

The pieces the RL learner (`learner.trainer`) has too come from the same modules: the process group
and the engine (`learner.engine`), token log-probs (`learner.modeling`), the mean over ranks and
the metrics writer (`learner.metrics`), resumable checkpoints (`learner.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from collections import defaultdict
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch

from learner.checkpoint import restore_latest, save_checkpoint, save_hf
from learner.engine import all_reduce_sum, build_engine, grad_norm, process_group, stopped
from learner.lora import is_lora, save_adapter
from learner.metrics import MetricsWriter, reduce_across_ranks
from learner.offline.config import OfflineConfig
from learner.offline.datasets import DataStats, Encoded, load_splits, report


class SetupError(ValueError):
    """A config that does not fit the data or the number of ranks (quotes the values)."""


# ------------------------------------------------------------------------------------------------
# set-up


def run_trainer(cfg: OfflineConfig, kind: str, make_trainer: Callable[..., "Trainer"], keep: str = "head",
                stop: threading.Event | None = None) -> dict:
    """An offline trainer's `train`: check the config, join the process group, load the tokenizer and
    the `kind` examples ("sft" or "pairs", truncated keeping their `keep`), then
    `make_trainer(cfg, tokenizer, data, rank, world, device) -> Trainer` and `fit` (until `stop` is
    set, if it is); returns the summary."""
    cfg.validate()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    with process_group(cfg.learner_config(1, 1)) as (rank, world, device):
        torch.manual_seed(cfg.seed)
        tokenizer = load_tokenizer(cfg.model_path, cfg.chat_template)
        data = load_data(cfg, tokenizer, kind, rank, keep)
        trainer = make_trainer(cfg, tokenizer, data, rank, world, device)
        return fit(cfg, trainer, data, rank, world, device, stop)


def logger(cfg: OfflineConfig) -> logging.Logger:
    """The trainer's log: `conveyor.sft`, `conveyor.dpo` or `conveyor.rm`."""
    return logging.getLogger(f"conveyor.{cfg.kind}")


def load_tokenizer(path: str, chat_template: str = ""):
    """The model's tokenizer (pad = eos when it has no pad token); `chat_template` replaces its
    own template (and is saved with it, since save_hf copies the tokenizer of model_path: see fit)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if chat_template:
        tok.chat_template = chat_template
    return tok


class Data(NamedTuple):
    """A trainer's examples: the training and held-out lists, and what loading them counted."""

    train: list
    held: list
    stats: list[DataStats]


def load_data(cfg: OfflineConfig, tokenizer, kind: str, rank: int, keep: str = "head") -> Data:
    """(train, held-out, stats) from learner.offline.datasets, reported by rank 0."""
    data = Data(*load_splits(tokenizer, cfg, kind, keep))
    if rank == 0:
        report(data.stats)
        logger(cfg).info(f"{len(data.train)} training and {len(data.held)} held-out examples")
    return data


# ------------------------------------------------------------------------------------------------
# batches


def pad_batch(seqs: Sequence[Encoded], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids (B, L), attention mask (B, L) and target mask (B, L-1): target[b, t] says that
    the token at t + 1 is a response token, i.e. that the logits at t are trained on."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    target = torch.zeros((len(seqs), L), dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s.ids)
        attn[b, : len(s)] = 1
        target[b, : len(s)] = torch.tensor(s.target, dtype=torch.bool)
    return ids.to(device), attn.to(device), target[:, 1:].to(device)


def pack_batch(seqs: Sequence[Encoded], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All sequences in one row, no padding: ids (1, N), position ids (1, N) restarting at 0 for each
    sequence and target mask (1, N-1). With no attention mask, transformers reads the position ids
    as packed documents and keeps attention inside each one (masking_utils.find_packed_sequence_indices)."""
    ids = torch.tensor([t for s in seqs for t in s.ids], dtype=torch.long)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    target = torch.tensor([t for s in seqs for t in s.target], dtype=torch.bool)
    target[pos == 0] = False  # a document's first token is not predicted from the previous document
    return ids[None].to(device), pos[None].to(device), target[None, 1:].to(device)


def packed_sums(values: torch.Tensor, seqs: Sequence[Encoded]) -> torch.Tensor:
    """(n,) per-sequence sums of a packed row's per-position values (1, N-1) from `pack_batch`:
    position t belongs to the sequence of token t + 1 (the token its logits predict)."""
    lengths = torch.tensor([len(s) for s in seqs], device=values.device)
    owner = torch.repeat_interleave(torch.arange(len(seqs), device=values.device), lengths)[1:]  # (N-1,)
    return torch.zeros(len(seqs), dtype=values.dtype, device=values.device).index_add(0, owner, values[0])


def packed_ends(seqs: Sequence[Encoded], device) -> torch.Tensor:
    """(n,) index of each sequence's last token in the packed row."""
    return torch.tensor([len(s) for s in seqs], device=device).cumsum(0) - 1


def steps_per_epoch(cfg: OfflineConfig, n_train: int, world: int) -> int:
    if cfg.batch_size % (cfg.micro_batch_size * world):
        raise SetupError(f"{cfg.kind}.batch_size={cfg.batch_size} is not a multiple of micro_batch_size="
                         f"{cfg.micro_batch_size} x {world} rank(s)")
    n = n_train // cfg.batch_size
    if n == 0:
        raise SetupError(f"{cfg.kind}: {n_train} training examples are fewer than batch_size={cfg.batch_size}")
    return n


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


# ------------------------------------------------------------------------------------------------
# the loop


def count(idx: list[int]) -> float:
    return float(len(idx))


@dataclasses.dataclass
class Trainer:
    """What one offline trainer plugs into `fit`."""

    build_model: Callable[[], torch.nn.Module]
    """The model to train (loaded, gradient checkpointing set); fit wraps it in DeepSpeed."""
    loss_fn: Callable[[object, list[int], float], tuple[torch.Tensor, dict[str, float]]]
    """(engine, training indices of one micro-batch, denom) -> (loss, metric contributions, each a
    sum over the micro-batch / denom, so their mean over micro-batches and ranks is the step's value)."""
    eval_fn: Callable[[object, list[int], list[float]], dict[str, float]] | None = None
    """(engine, held-out indices, weights 0/1) -> sums (weights say which rows count); None: no evaluation."""
    finish_eval: Callable[[dict[str, float]], dict[str, float]] | None = None
    """Sums over the whole held-out set -> metrics (`eval/...`)."""
    weight_fn: Callable[[list[int]], float] = count
    """Training indices of a whole global batch -> what its loss is averaged over (default: the
    number of examples, i.e. pairs for DPO and RM)."""


def fit(cfg: OfflineConfig, trainer: Trainer, data: Data, rank: int, world: int, device: torch.device,
        stop: threading.Event | None = None) -> dict:
    """Train, evaluate and save; returns a summary (also written to <run_dir>/summary.json by rank 0).
    `stop` set (on any rank: the ranks agree between steps) ends the training early, then evaluates
    and saves the same way. However it ends, the metrics writer is closed."""
    save_path, run_dir = cfg.output_dirs()
    n_train = len(data.train)
    per_epoch = steps_per_epoch(cfg, n_train, world)
    total = per_epoch * cfg.epochs
    lcfg = cfg.learner_config(total, world)
    engine = build_engine(trainer.build_model(), lcfg)
    grad_accum = lcfg.gradient_accumulation_steps

    step, ckpt = 0, None
    if cfg.resume:
        step, ckpt = restore_latest(run_dir, engine, ranks_key="the number of ranks",
                                    zero_key=f"{cfg.kind}.zero_stage")
    if ckpt is not None and rank == 0:
        logger(cfg).info(f"resumed from {ckpt} at step {step}")

    with ExitStack() as opened:
        writer = opened.enter_context(closing(MetricsWriter.for_run(run_dir, cfg))) if rank == 0 else None
        if rank == 0:
            logger(cfg).info(f"{world} rank(s), ZeRO-{cfg.zero_stage}, {cfg.dtype}: {cfg.epochs} epoch(s) x "
                             f"{per_epoch} steps of {cfg.batch_size} ({grad_accum} micro-batch(es) of "
                             f"{cfg.micro_batch_size} per rank)")

        def evaluate(at: int) -> dict[str, float]:
            if trainer.eval_fn is None or not data.held:
                return {}
            out = run_eval(cfg, trainer, engine, len(data.held), rank, world, device)
            if rank == 0:
                writer.log(at, out)
                logger(cfg).info(f"step {at}: " + " ".join(f"{k} {v:.4f}" for k, v in sorted(out.items())))
            return out

        summary: dict = {"kind": cfg.kind, "data": [dataclasses.asdict(s) for s in data.stats], "steps": total,
                         "save_path": save_path, "world_size": world, "zero_stage": engine.zero_optimization_stage()}
        if rank == 0:  # rows read, used, skipped as bad, truncated, dropped: once, at the starting step
            counts: dict[str, float] = defaultdict(float)
            for s in data.stats:  # summed over the files of each role
                for k, v in s.as_metrics(s.role).items():
                    counts[k] += float(v)
            writer.log(step, dict(counts))
        summary["eval_start"] = evaluate(step)
        last: dict[str, float] = {}
        saved = step
        t_start = time.monotonic()
        done = 0
        for epoch in range(cfg.epochs):
            order = epoch_order(n_train, cfg.seed, epoch)
            for s in range(per_epoch):
                if epoch * per_epoch + s < step:
                    continue  # done before the checkpoint we resumed from
                if stopped(stop, world, device):
                    break  # (and at the first step of every epoch left)
                t0 = time.monotonic()
                metrics = optimizer_step(cfg, trainer, engine, order[s * cfg.batch_size:(s + 1) * cfg.batch_size],
                                         rank, world, grad_accum, device)
                step += 1
                done += 1
                metrics.update({"optim/lr": float(engine.get_lr()[0]), "optim/grad_norm": grad_norm(engine),
                                "time/train_step": time.monotonic() - t0, "train/epoch": epoch + (s + 1) / per_epoch})
                last = metrics
                if rank == 0 and (step % cfg.log_every == 0 or step == total):
                    writer.log(step, metrics)
                    loss_keys = [k for k in sorted(metrics) if k.startswith(("loss/", "rewards/", "rm/"))][:4]
                    logger(cfg).info(f"step {step}/{total}: " + " ".join(f"{k} {metrics[k]:.4f}" for k in loss_keys))
                if cfg.eval_every and step % cfg.eval_every == 0 and step != total:
                    evaluate(step)
                if cfg.save_every and step % cfg.save_every == 0:
                    save_checkpoint(run_dir, step, engine, None, cfg.model_path, keep=cfg.keep_checkpoints,
                                    merged=cfg.lora_save_merged)
                    saved = step
        summary["eval_end"] = evaluate(step)
        summary["train_last"] = last
        summary["train_s"] = time.monotonic() - t_start
        summary["steps_run"] = done
        if cfg.save_every and saved != step:
            save_checkpoint(run_dir, step, engine, None, cfg.model_path, keep=cfg.keep_checkpoints,
                            merged=cfg.lora_save_merged)
        save_hf(engine, Path(save_path), cfg.model_path)  # with LoRA: merged, and the adapter in adapter/
        if cfg.chat_template and rank == 0:  # the tokenizer as trained with: its template replaced
            load_tokenizer(cfg.model_path, cfg.chat_template).save_pretrained(save_path)
        if is_lora(engine):
            save_adapter(engine, Path(save_path) / "adapter")
        if rank == 0:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            logger(cfg).info(f"saved the trained model to {save_path}")
    torch.distributed.barrier()
    return summary


def optimizer_step(cfg: OfflineConfig, trainer: Trainer, engine, batch: list[int], rank: int, world: int,
                   grad_accum: int, device: torch.device) -> dict[str, float]:
    """One optimizer step on the global batch `batch` (training indices): this rank's slice in
    micro-batches; returns the metric contributions, averaged over micro-batches and ranks."""
    per_rank = cfg.batch_size // world
    mine = batch[rank * per_rank:(rank + 1) * per_rank]
    denom = trainer.weight_fn(batch) / (world * grad_accum)
    engine.train()
    sums: dict[str, float] = defaultdict(float)
    for i in range(0, per_rank, cfg.micro_batch_size):
        loss, contrib = trainer.loss_fn(engine, mine[i:i + cfg.micro_batch_size], max(denom, 1e-12))
        engine.backward(loss)
        engine.step()  # DeepSpeed updates at the last micro-batch of the step
        for k, v in contrib.items():
            sums[k] += v / grad_accum
    return reduce_across_ranks(dict(sums), device)


@torch.no_grad()
def run_eval(cfg: OfflineConfig, trainer: Trainer, engine, n_eval: int, rank: int, world: int,
             device: torch.device) -> dict[str, float]:
    """trainer.eval_fn over the held-out set: each rank takes every world-th example, every rank runs
    the same number of forwards (ZeRO-3 gathers parameters in them), rows past the end weigh 0."""
    engine.eval()
    shard = list(range(rank, n_eval, world))
    n_batches = math.ceil(math.ceil(n_eval / world) / cfg.micro_batch_size)
    sums: dict[str, float] = defaultdict(float)
    for b in range(n_batches):
        idx = shard[b * cfg.micro_batch_size:(b + 1) * cfg.micro_batch_size]
        weights = [1.0] * len(idx)
        if not idx:
            idx, weights = [0], [0.0]
        for k, v in trainer.eval_fn(engine, idx, weights).items():
            sums[k] += v
    keys = sorted(sums) or ["_"]
    t = torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64, device=device)
    if world > 1:
        t = all_reduce_sum(t)
    engine.train()
    return trainer.finish_eval(dict(zip(keys, t.tolist())))
