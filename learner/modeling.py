"""Model helpers shared by the learner and the scorers: loading, and token log-probs.

Light on purpose (no DeepSpeed import): the reference scorer computes its log-probs with exactly
the function the learner trains with, so the KL term compares like with like.

Packing (`learner.packing`): `next_token_stats` and `completion_logprobs` can run the model on a
batch's sequences packed into rows without padding and hand the results back on the padded frame;
`next_token_logits` takes the position ids of a packed row directly (the SFT trainer's one row).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn.functional as F

from learner.packing import PackedRows, pack_rows

MEMORY_SHARE_ENV = "CONVEYOR_CUDA_MEMORY_FRACTION"  # set by the launcher's device plan (launch/devices/plan.py)


def cuda_index(local_rank: int, count: int) -> int:
    """The CUDA device a rank takes: its local rank among the devices it sees, or the only one
    (a launcher that gives each rank one device in CUDA_VISIBLE_DEVICES)."""
    if count == 1:
        return 0
    if not 0 <= local_rank < count:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this process sees {count} CUDA device(s) "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return local_rank


def apply_memory_share(device) -> float:
    """Cap this process's use of CUDA `device` at the share the device plan gave it (when it
    shares the device with a vLLM engine or a scorer): a role over its budget then fails itself,
    with torch's out-of-memory error, instead of the neighbour whose memory it took. Returns the
    share (0: none)."""
    share = float(os.environ.get(MEMORY_SHARE_ENV, "0") or 0)
    if share and str(device).startswith("cuda"):
        d = torch.device(device)  # ("cuda" names no index, which this call refuses: the current device)
        torch.cuda.set_per_process_memory_fraction(min(share, 1.0), d.index if d.index is not None
                                                   else torch.cuda.current_device())
    return share


def load_causal_lm(path: str, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """Any `AutoModelForCausalLM` folder (or a vision-language model's: `learner.vision`), in eval mode."""
    from learner.vision import auto_model_class

    apply_memory_share(device)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = auto_model_class(path).from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def gather_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) at `labels`.

    logits: (B, L, V); labels: (B, L) -> (B, L). Computed in fp32 whatever the model's dtype, via
    logsumexp so the (B, L, V) log-softmax is never materialised twice.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)  # (B, L)
    return picked - torch.logsumexp(logits, dim=-1)


def pad_sequences(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+completion batch.

    Returns input_ids (B, L), attention_mask (B, L) and completion_mask (B, L-1), where
    completion_mask[b, t] says that the token at position t+1 is a completion token (the logits at
    position t predict it).
    """
    seqs = [list(map(int, p)) + list(map(int, c)) for p, c in zip(prompts, completions)]
    L = max(len(s) for s in seqs)
    B = len(seqs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    completion_mask = torch.zeros((B, L - 1), dtype=torch.bool)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        input_ids[b, :n] = torch.tensor(seqs[b], dtype=torch.long)
        attention_mask[b, :n] = 1
        completion_mask[b, len(p) - 1 : n - 1] = True
    return input_ids, attention_mask, completion_mask


def next_token_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None, vision=None) -> torch.Tensor:
    """(B, L) ids -> (B, L-1, V) logits: position t predicts token t + 1 (grad flows).

    `position_ids` without an attention mask: packed rows of documents (transformers keeps
    attention inside each document when the positions restart at 0, but only with no cache:
    hence use_cache=False). `vision` (`learner.vision.VisionRows` of these rows): a
    vision-language policy's images, whose features take the places of their placeholders."""
    extra = {} if vision is None else vision.forward_kwargs(input_ids)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                **extra)
    return out.logits[:, :-1]


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of every next token under `model`: (B, L) ids -> (B, L-1) log-probs (grad flows).

    With `next_token_logits`, where every log-prob the learners and the reference scorer use comes
    from: the RL learner's pi_old (and its pi, from the logits it also needs for the entropy), the
    reference log-probs, SFT's and DPO's."""
    logits = next_token_logits(model, input_ids, attention_mask, position_ids)  # (B, L-1, V)
    return gather_logprobs(logits, input_ids[:, 1:], temperature)


def next_token_stats(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                     packed: PackedRows | None = None, entropy: bool = False,
                     sp=None, routes: torch.Tensor | None = None,
                     vision=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, L-1) of every next token of a right-padded (B, L) batch and, with `entropy`,
    the entropy (B, L-1) of each prediction at `temperature` (grad flows through both).

    With `packed` (`learner.packing.pack_rows` of this batch) the model runs on the packed rows
    and both come back on the padded frame, 0 where the padded frame predicts no token of a
    sequence; on the positions that do, they equal the padded forward's (tests/learner/test_packing.py).
    Only per-token results are unpacked, never the (., ., V) logits.

    `sp` (a `learner.sequence_parallel.SequenceParallel`): the rows' positions are shared by the
    ranks of its group, each running its slice; the results are whole on every rank.

    `routes` (B, L, layers, k): a mixture-of-experts policy's forward routes each token to these
    experts (routing replay) and measures its routers (`learner.moe.routing`).

    `vision` (`learner.vision.VisionRows`): the rows' images; such rows are neither packed nor
    split over a sequence-parallel group (M-RoPE positions come from each whole sequence)."""
    from learner.moe import routing

    if vision is not None and (packed is not None or sp is not None):
        raise ValueError("rows with images are neither packed nor sequence-parallel (learner.packing, "
                         "learner.sequence_parallel_size): M-RoPE positions are computed per whole sequence")
    unpack = None if packed is None else packed.unpack_next
    if sp is None:
        with routing(model, routes, attention_mask, packed):
            logprobs, ent = _token_stats(model, input_ids, attention_mask, temperature, packed, entropy, vision)
    else:
        ids, pos = (input_ids, None) if packed is None else (packed.input_ids, packed.position_ids)
        logprobs, ent = sp.token_stats(model, ids, pos, temperature, entropy)
    if unpack is not None:
        logprobs = unpack(logprobs)
        ent = unpack(ent) if ent is not None else None
    return logprobs, ent


def _token_stats(model, input_ids, attention_mask, temperature, packed, entropy, vision=None):
    if packed is None:
        logits = next_token_logits(model, input_ids, attention_mask, vision=vision)  # (B, L-1, V)
        labels = input_ids[:, 1:]
    else:
        logits = next_token_logits(model, packed.input_ids, position_ids=packed.position_ids)  # (R, C-1, V)
        labels = packed.input_ids[:, 1:]
    logprobs = gather_logprobs(logits, labels, temperature)
    return logprobs, entropy_from_logits(logits / temperature) if entropy else None


@torch.no_grad()
def completion_logprobs(
    model,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperature: float = 1.0,
    batch_size: int = 16,
    pad_id: int = 0,
    packing: bool = True,
    images: Sequence[Sequence[bytes] | None] | None = None,
    pixels=None,
) -> list[torch.Tensor]:
    """Per-token log-probs of each completion given its prompt: a list of (T_i,) fp32 tensors.

    `batch_size` sequences per forward; `packing`: packed into rows without padding (equal to the
    padded forward's within float rounding, and faster on mixed lengths: bench/packing.py).
    `images` (each row's encoded images, or None) with `pixels` (`learner.vision.Pixels` of the
    model): a vision-language model's rows, run padded with their pixels."""
    from learner.vision import VisionRows

    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for i in range(0, len(prompts), batch_size):
        p, c = prompts[i : i + batch_size], completions[i : i + batch_size]
        ids, attn, cmask = pad_sequences(p, c, pad_id)
        ids, attn = ids.to(device), attn.to(device)
        rows = images[i : i + batch_size] if images is not None and pixels is not None else None
        vision = VisionRows.of(pixels, rows, ids.cpu()).to(device) if rows and any(rows) else None
        packed = pack_rows(ids, attn) if packing and vision is None else None
        lp = next_token_stats(model, ids, attn, temperature, packed, vision=vision)[0].cpu()  # (B, L-1)
        for b in range(len(p)):
            out.append(lp[b][cmask[b]].clone())
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, L, V) -> (B, L) entropy of softmax(logits)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
