"""Supervised fine-tuning: next-token NLL on the response tokens only.

`python -m launch.sft CONFIG` (or `deepspeed --num_gpus N --module launch.sft CONFIG`) calls `run`.
Micro-batches are padded to their longest sequence, or packed into one row (`packing`); the loss
is the mean over every response token of the global batch (not a mean of per-sequence means), and
the held-out loss is the same mean over the held-out set.
"""

from __future__ import annotations

import threading

import torch

from learner.engine import load_trainable_lm
from learner.modeling import token_logprobs
from learner.offline.config import SFTConfig
from learner.offline.loop import Data, Trainer, pack_batch, pad_batch, run_trainer


def sft_loss(logprobs: torch.Tensor, target: torch.Tensor, denom: float | torch.Tensor) -> torch.Tensor:
    """Sum of -log p over the target tokens / denom. logprobs, target: (B, T)."""
    return -(logprobs * target.to(logprobs.dtype)).sum() / denom


def run(cfg: SFTConfig, stop: threading.Event | None = None) -> int:
    """The trainer's role (`python -m launch.sft`): `train`; the exit code."""
    train(cfg, stop)
    return 0


def train(cfg: SFTConfig, stop: threading.Event | None = None) -> dict:
    """Train (until `stop` is set, if it is), evaluate, save to cfg.save_path; returns the summary
    (eval_start, eval_end, train_last, data)."""
    return run_trainer(cfg, "sft", make_trainer, stop=stop)


def make_trainer(cfg: SFTConfig, tok, data: Data, rank: int, world: int, device: torch.device) -> Trainer:
    """The SFT loss (averaged over the global batch's response tokens) and its held-out evaluation."""
    train_set, held = data.train, data.held
    pad_id = tok.pad_token_id

    def forward(engine, seqs, packed: bool):
        if packed:
            ids, pos, target = pack_batch(seqs, device)
            return token_logprobs(engine, ids, position_ids=pos), target  # (1, N-1)
        ids, attn, target = pad_batch(seqs, pad_id, device)
        return token_logprobs(engine, ids, attention_mask=attn), target  # (B, L-1)

    def loss_fn(engine, idx, denom):
        logprobs, target = forward(engine, [train_set[i] for i in idx], cfg.packing)
        loss = sft_loss(logprobs, target, denom)
        return loss, {"loss/sft": loss.item()}

    def weight_fn(idx):
        # response tokens the loss is averaged over (the first token of a sequence is never predicted)
        return float(sum(sum(train_set[i].target[1:]) for i in idx))

    def eval_fn(engine, idx, weights):
        logprobs, target = forward(engine, [held[i] for i in idx], packed=False)
        w = torch.tensor(weights, device=logprobs.device)[:, None]  # (B, 1)
        m = target.float() * w
        return {"nll": float(-(logprobs * m).sum()), "tokens": float(m.sum())}

    def finish_eval(sums):
        return {"eval/loss": sums["nll"] / max(sums["tokens"], 1.0), "eval/tokens": sums["tokens"]}

    return Trainer(build_model=lambda: load_trainable_lm(cfg.model_path, cfg.gradient_checkpointing),
                   loss_fn=loss_fn, eval_fn=eval_fn, finish_eval=finish_eval, weight_fn=weight_fn)
