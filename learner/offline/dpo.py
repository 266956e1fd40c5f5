"""Direct preference optimisation: DPO, IPO and conservative DPO (label smoothing), optional NLL term.

`python -m launch.dpo CONFIG` (or under `deepspeed`) calls `run`. With log-probs summed over the
response tokens, logp_pi(y) and logp_ref(y), and

    h = (logp_pi(chosen) - logp_ref(chosen)) - (logp_pi(rejected) - logp_ref(rejected))

the per-pair loss is
    sigmoid (DPO):  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps = label_smoothing, cDPO)
    ipo:            (h - 1 / (2 beta))^2
and the implicit rewards are beta (logp_pi - logp_ref) of each response. The reference log-probs are
computed once before training (`ref_mode: precompute`, then the reference model is freed) or beside
every micro-batch (`on_the_fly`). Chosen and rejected go through the model as one batch. With LoRA
(`lora_rank > 0`) and no `ref_path`, `on_the_fly` needs no second model: the reference is the
policy with its adapter switched off (the frozen base). With `packing`, a micro-batch's chosen and
rejected sequences go through as one packed row (no padding), the reference's too.
"""

from __future__ import annotations

import gc
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from learner.engine import load_trainable_lm
from learner.lora import adapter_disabled
from learner.modeling import token_logprobs
from learner.offline.config import DPOConfig
from learner.offline.loop import Data, Trainer, logger, pack_batch, packed_sums, pad_batch, run_trainer


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses (B,) and the implicit rewards of chosen and rejected (B,), detached.

    Every input is a (B,) sum of response-token log-probs.
    """
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)  # (B,)
    if loss == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    elif loss == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        raise ValueError(f"unknown DPO loss {loss!r}; expected 'sigmoid' or 'ipo'")
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def run(cfg: DPOConfig, stop: threading.Event | None = None) -> int:
    """The trainer's role (`python -m launch.dpo`): `train`; the exit code."""
    train(cfg, stop)
    return 0


def train(cfg: DPOConfig, stop: threading.Event | None = None) -> dict:
    """Train (until `stop` is set, if it is), evaluate, save to cfg.save_path; returns the summary
    (eval_start, eval_end, train_last, data)."""
    return run_trainer(cfg, "pairs", make_trainer, stop=stop)


def make_trainer(cfg: DPOConfig, tok, data: Data, rank: int, world: int, device: torch.device) -> Trainer:
    """The DPO loss and its held-out evaluation; the reference log-probs are computed here first
    (`precompute`) or the reference model stays beside the policy (`on_the_fly`)."""
    train_set, held = data.train, data.held
    pad_id = tok.pad_token_id
    dtype = getattr(torch, cfg.dtype)

    def response_logps(model, pairs):
        """(chosen, rejected, chosen token counts): (b,) each; both halves in one padded batch, or
        packed into one row (`packing`)."""
        seqs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        if cfg.packing:
            ids, pos, target = pack_batch(seqs, device)
            lp = token_logprobs(model, ids, position_ids=pos)  # (1, N-1)
            sums, counts = packed_sums(lp * target, seqs), packed_sums(target.to(lp.dtype), seqs)  # (2b,)
        else:
            ids, attn, target = pad_batch(seqs, pad_id, device)
            lp = token_logprobs(model, ids, attention_mask=attn)  # (2b, L-1)
            sums, counts = (lp * target).sum(-1), target.sum(-1)  # (2b,)
        b = len(pairs)
        return sums[:b], sums[b:], counts[:b].clamp_min(1)

    base_is_ref = cfg.lora_rank > 0 and not cfg.ref_path and cfg.ref_mode == "on_the_fly"
    ref_model = None if base_is_ref else load_reference(cfg, dtype, device)
    ref = {}
    if cfg.ref_mode == "precompute":
        # once, sharded over ranks and summed back: every rank ends with every pair's reference log-probs
        ref = {"train": precompute(lambda p: response_logps(ref_model, p)[:2], train_set, rank, world, device,
                                   cfg.micro_batch_size),
               "eval": precompute(lambda p: response_logps(ref_model, p)[:2], held, rank, world, device,
                                  cfg.micro_batch_size)}
        del ref_model
        ref_model = None
        gc.collect()
        if rank == 0:
            logger(cfg).info(f"reference log-probs of {len(train_set) + len(held)} pairs computed; "
                             "reference model freed")

    def ref_logps(engine, split, pairs, idx):
        if base_is_ref:
            with torch.no_grad(), adapter_disabled(engine):
                c, r, _ = response_logps(engine, pairs)
            return c, r
        if ref_model is None:
            r = ref[split][torch.tensor(idx)]  # (b, 2)
            return r[:, 0], r[:, 1]
        with torch.no_grad():
            c, r, _ = response_logps(ref_model, pairs)
        return c, r

    def losses_of(engine, split, data, idx):
        pairs = [data[i] for i in idx]
        pc, pr, n_chosen = response_logps(engine, pairs)
        rc, rr = ref_logps(engine, split, pairs, idx)
        rc, rr = rc.to(device=pc.device, dtype=pc.dtype), rr.to(device=pc.device, dtype=pc.dtype)
        losses, cr, rr_ = dpo_loss(pc, pr, rc, rr, cfg.beta, cfg.loss, cfg.label_smoothing)
        nll = -pc / n_chosen  # (b,) token-mean NLL of each chosen response
        return losses, cr, rr_, nll

    def loss_fn(engine, idx, denom):
        losses, cr, rr, nll = losses_of(engine, "train", train_set, idx)
        pref = losses.sum() / denom
        loss = pref + cfg.nll_coef * nll.sum() / denom if cfg.nll_coef else pref
        margin = cr - rr
        return loss, {"loss/dpo": pref.item(), "loss/nll": nll.detach().sum().item() / denom, "loss/total": loss.item(),
                      "rewards/chosen": cr.sum().item() / denom, "rewards/rejected": rr.sum().item() / denom,
                      "rewards/margin": margin.sum().item() / denom,
                      "rewards/accuracy": (margin > 0).float().sum().item() / denom}

    def eval_fn(engine, idx, weights):
        losses, cr, rr, nll = losses_of(engine, "eval", held, idx)
        w = torch.tensor(weights, device=losses.device, dtype=losses.dtype)
        margin = cr - rr
        return {"loss": float((losses * w).sum()), "nll": float((nll * w).sum()), "chosen": float((cr * w).sum()),
                "rejected": float((rr * w).sum()), "margin": float((margin * w).sum()),
                "correct": float(((margin > 0).to(w.dtype) * w).sum()), "n": float(w.sum())}

    def finish_eval(s):
        n = max(s["n"], 1.0)
        return {"eval/loss": s["loss"] / n, "eval/nll": s["nll"] / n, "eval/rewards_chosen": s["chosen"] / n,
                "eval/rewards_rejected": s["rejected"] / n, "eval/margin": s["margin"] / n,
                "eval/accuracy": s["correct"] / n, "eval/pairs": s["n"]}

    return Trainer(build_model=lambda: load_trainable_lm(cfg.model_path, cfg.gradient_checkpointing),
                   loss_fn=loss_fn, eval_fn=eval_fn, finish_eval=finish_eval)  # averaged over pairs


def load_reference(cfg: DPOConfig, dtype: torch.dtype, device: torch.device):
    """The frozen reference policy: a whole copy on every rank, in eval mode, no grad."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.ref_path or cfg.model_path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def precompute(fn, pairs: list, rank: int, world: int, device: torch.device, micro: int) -> torch.Tensor:
    """(N, 2) float64 [chosen, rejected] reference log-probs of every pair; each rank computes its
    contiguous shard, the shards are summed together over ranks."""
    out = torch.zeros((len(pairs), 2), dtype=torch.float64, device=device)
    per_rank = -(-len(pairs) // world)
    lo, hi = rank * per_rank, min(len(pairs), (rank + 1) * per_rank)
    for i in range(lo, hi, micro):
        chunk = pairs[i:min(hi, i + micro)]
        c, r = fn(chunk)
        out[i:i + len(chunk), 0] = c.double()
        out[i:i + len(chunk), 1] = r.double()
    if world > 1:
        dist.all_reduce(out)
    return out.cpu()
