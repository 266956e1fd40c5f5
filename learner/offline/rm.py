"""Reward model: a scalar head on a transformer, trained with the Bradley-Terry loss on preference pairs.

`python -m launch.rm CONFIG` (or under `deepspeed`) calls `run`. The model is an
`AutoModelForSequenceClassification` with num_labels=1: from a sequence-classification folder as
it is, from a causal LM folder (the tiny model, any policy) as the same architecture's
`...ForSequenceClassification` with the backbone's weights and a new head. Its score of a sequence
is the head's output at the last non-pad token, which is exactly how the scorer's `reward_model`
kind (actors.rewards.RewardModel) reads it; the saved folder has num_labels=1 and pad_token_id set.

    loss = -log sigmoid(r_chosen - r_rejected - margin)     (margin: 0, or the row's `margin_key`)
    loss = log(1 + exp(r_rejected - r_chosen))             (`loss: logexpsigmoid`; no margin)

With `packing`, a micro-batch's sequences go through as one row without padding and each is
scored at its own last token (the head's per-token output, read before the model pools it).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from learner.engine import enable_gradient_checkpointing
from learner.lora import is_lora
from learner.offline.config import RMConfig
from learner.offline.loop import Data, Trainer, pack_batch, packed_ends, pad_batch, run_trainer


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor,
                       margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per-pair losses (B,) from the scores of the chosen and rejected sequences (B,)."""
    return -F.logsigmoid(chosen - rejected - margin)


def pair_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0,
              kind: str = "sigmoid") -> torch.Tensor:
    """Per-pair losses (B,): `sigmoid` is bradley_terry_loss; `logexpsigmoid` is log(1 + exp(r_r - r_c)),
    written as softplus so a large gap cannot overflow exp, and it ignores the margin (as OpenRLHF's
    LogExpLoss does)."""
    if kind == "sigmoid":
        return bradley_terry_loss(chosen, rejected, margin)
    if kind == "logexpsigmoid":
        return F.softplus(rejected - chosen)
    raise ValueError(f"unknown reward-model loss {kind!r}; expected 'sigmoid' or 'logexpsigmoid'")


@contextmanager
def per_token_scores(model):
    """Inside the block, `out[0]` is the score head's output at every token, (B, T) before the model
    pools it at the last non-pad token: what a packed row needs (a score at each sequence's end)."""
    inner = getattr(model, "module", model)
    base = inner.get_base_model() if is_lora(inner) else inner
    out: list[torch.Tensor] = []
    handle = base.score.register_forward_hook(lambda _m, _i, o: out.append(o[..., 0]))
    try:
        yield out
    finally:
        handle.remove()


def load_reward_model(path: str, pad_token_id: int, dtype: torch.dtype = torch.float32):
    """An AutoModelForSequenceClassification with one label from any causal LM or classifier folder.

    From a causal LM folder, transformers loads the backbone's weights (`model.*`) into the
    classifier and initialises the new `score` head (it reports the head as newly initialised).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path)
    config.num_labels = 1
    # the model pools at the last token that is not padding: it must know the id batches are padded with
    config.pad_token_id = pad_token_id
    model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=dtype)
    model.config.use_cache = False
    # saved configs say what the folder now is, whatever it was loaded from
    model.config.architectures = [type(model).__name__]
    return model


def run(cfg: RMConfig, stop: threading.Event | None = None) -> int:
    """The trainer's role (`python -m launch.rm`): `train`; the exit code."""
    train(cfg, stop)
    return 0


def train(cfg: RMConfig, stop: threading.Event | None = None) -> dict:
    """Train (until `stop` is set, if it is), evaluate, save to cfg.save_path; returns the summary
    (eval_start, eval_end, train_last, data)."""
    # keep the tail of a long sequence, as the scorer does (the response is what is judged)
    return run_trainer(cfg, "pairs", make_trainer, keep="tail", stop=stop)


def make_trainer(cfg: RMConfig, tok, data: Data, rank: int, world: int, device: torch.device) -> Trainer:
    """The Bradley-Terry loss of the reward model and its held-out evaluation (accuracy, margins)."""
    train_set, held = data.train, data.held
    pad_id = tok.pad_token_id

    def scores(model, pairs):
        """(chosen, rejected, margin): (b,) each; both halves in one padded batch, or packed into one row."""
        seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        if cfg.packing:
            ids, pos, _ = pack_batch(seqs, device)
            with per_token_scores(model) as out:
                model(input_ids=ids, position_ids=pos)
            r = out[0][0, packed_ends(seqs, device)].float()  # (2b,) at each sequence's last token
        else:
            ids, attn, _ = pad_batch(seqs, pad_id, device)
            r = model(input_ids=ids, attention_mask=attn).logits[:, 0].float()  # (2b,) at the last real token
        margin = torch.tensor([p.margin for p in pairs], dtype=r.dtype, device=r.device)
        return r[: len(pairs)], r[len(pairs):], margin

    def loss_fn(engine, idx, denom):
        rc, rr, margin = scores(engine, [train_set[i] for i in idx])
        loss = pair_loss(rc, rr, margin, cfg.loss).sum() / denom
        return loss, {"loss/rm": loss.item(), "rm/accuracy": (rc > rr).float().sum().item() / denom,
                      "rm/chosen": rc.sum().item() / denom, "rm/rejected": rr.sum().item() / denom,
                      "rm/margin": (rc - rr).sum().item() / denom}

    def eval_fn(engine, idx, weights):
        rc, rr, margin = scores(engine, [held[i] for i in idx])
        w = torch.tensor(weights, dtype=rc.dtype, device=rc.device)
        return {"loss": float((pair_loss(rc, rr, margin, cfg.loss) * w).sum()),
                "correct": float(((rc > rr).to(w.dtype) * w).sum()), "chosen": float((rc * w).sum()),
                "rejected": float((rr * w).sum()), "sq": float(((rc.square() + rr.square()) * w).sum()),
                "n": float(w.sum())}

    def finish_eval(s):
        n = max(s["n"], 1.0)
        mean = (s["chosen"] + s["rejected"]) / (2 * n)
        return {"eval/loss": s["loss"] / n, "eval/accuracy": s["correct"] / n, "eval/chosen": s["chosen"] / n,
                "eval/rejected": s["rejected"] / n, "eval/margin": (s["chosen"] - s["rejected"]) / n,
                "eval/reward_std": max(0.0, s["sq"] / (2 * n) - mean * mean) ** 0.5, "eval/pairs": s["n"]}

    def build_model():
        return enable_gradient_checkpointing(load_reward_model(cfg.model_path, pad_id), cfg.gradient_checkpointing)

    return Trainer(build_model=build_model, loss_fn=loss_fn, eval_fn=eval_fn, finish_eval=finish_eval)  # over pairs
