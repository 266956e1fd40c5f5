"""Sequence parallelism: the ranks of a group share every sequence of one share of the batch
(`learner.sequence_parallel`, OpenRLHF's `--ds.ring_attn_size`), DeepSpeed-Ulysses style.

The learner's `world` ranks form world / size data-parallel groups of `size` consecutive ranks.
The first rank of each group (its leader) asks the buffer for the group's share (share index =
rank // size, of world // size shares) and sends it to the others, so every rank of a group holds
the same rows. Each forward then cuts the sequence dimension into `size` equal slices (the row
padded to a multiple of `size`): rank i runs the embeddings, MLPs and head on slice i only, with
the slice's true position ids (rotary embeddings see where the tokens are). Attention needs every
position, so each attention layer swaps the sequence split for a head split (an all-to-all: rank i
gets every position of heads [i*H/size, (i+1)*H/size)), attends causally within each document
(documents: where the position ids restart at 0, i.e. packed rows; a right-padded row is one),
and swaps back. Per-token results (log-probs, entropy, values) are gathered to the whole row on
every rank, so the losses, advantages and metrics are the same code as without it.

Gradients. Every rank of a group holds the share and computes the same loss on the same gathered
tensors, as `size` copies of one data-parallel rank would: the learner's token counts and the
ranks' mean of the metrics count the share once per rank, so each rank's loss is 1/size of the
share's. The gather's backward is then what all_gather's is, a sum over the group of every rank's
gradient for this rank's slice: the ranks' gradients are equal, so it is `size` times its own,
taken without a collective. The group's parameter gradients sum to the share's, and DeepSpeed's
average over all `world` ranks is the data-parallel update (tests/learner/test_sequence_parallel.py:
the same weights as one rank holding whole sequences, and the same loss metrics).

Activation memory per rank falls with `size` (the attention's L x L scores stay whole per head:
the gain is in the MLPs and the vocabulary head, which dominate at long context). The all-to-all
runs on gloo (CPU) and NCCL alike (torch.distributed.all_to_all_single); heads must divide by
`size` (key/value heads that do not are repeated to the query heads first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from learner.modeling import entropy_from_logits, gather_logprobs

ATTENTION = "conveyor_ulysses"

_active: dict = {}  # while a sharded forward runs: the group and the rows' document ids (B, L)


@dataclasses.dataclass
class SequenceParallel:
    """This rank's place: `size` ranks per group, `index` within it, the group's `leader` (global
    rank) and process group, and the data-parallel share this group trains (`share` of `shares`)."""

    size: int
    index: int
    leader: int
    group: object
    share: int
    shares: int

    @property
    def leads(self) -> bool:
        return self.index == 0

    @classmethod
    def create(cls, size: int, rank: int, world: int) -> SequenceParallel:
        """The groups of `size` consecutive ranks (collective: every rank creates every group)."""
        if world % size:
            raise ValueError(f"learner.sequence_parallel={size} does not divide the {world} learner rank(s) "
                             f"(run.learner_ranks): each group of {size} ranks shares one data-parallel share")
        mine = None
        for first in range(0, world, size):
            g = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                mine = g
        return cls(size, rank % size, rank - rank % size, mine, rank // size, world // size)

    # ---- the batch ---------------------------------------------------------------------------

    def share_batch(self, batch, device: torch.device):
        """The leader's `batch` (a buffer `Batch`) on every rank of the group (collective in it);
        sent as the buffer's own msgpack frames."""
        from buffer.messages import decode, encode

        if self.leads:
            frames = [bytes(f) for f in encode(batch)]
            sizes = torch.tensor([len(frames)] + [len(f) for f in frames], dtype=torch.int64, device=device)
            n = torch.tensor([sizes.numel()], dtype=torch.int64, device=device)
        else:
            n = torch.zeros(1, dtype=torch.int64, device=device)
        dist.broadcast(n, self.leader, group=self.group)
        if not self.leads:
            sizes = torch.zeros(int(n.item()), dtype=torch.int64, device=device)
        dist.broadcast(sizes, self.leader, group=self.group)
        lengths = sizes[1:].tolist()
        if self.leads:
            data = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8).to(device)
        else:
            data = torch.empty(sum(lengths), dtype=torch.uint8, device=device)
        if data.numel():
            dist.broadcast(data, self.leader, group=self.group)
        if self.leads:
            return batch
        raw = data.cpu().numpy().tobytes()
        offsets = [0]
        for n_bytes in lengths:
            offsets.append(offsets[-1] + n_bytes)
        return decode([raw[a:b] for a, b in zip(offsets, offsets[1:])])

    # ---- forwards ----------------------------------------------------------------------------

    def token_stats(self, model, input_ids: torch.Tensor, position_ids: torch.Tensor | None, temperature: float,
                    entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`learner.modeling.next_token_stats` of rows (B, L) with this group: log-probs (B, L-1)
        and, with `entropy`, the entropies (B, L-1), whole on every rank (grad flows)."""
        L = input_ids.shape[1]
        ids, pos, lo, hi = self._slice_inputs(input_ids, position_ids)
        labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)[:, lo:hi]  # (the last position's label is cut off)
        with self._sharded(model, pos):
            logits = model(input_ids=ids[:, lo:hi], position_ids=pos[:, lo:hi], use_cache=False).logits
        lp = gather_sequence(gather_logprobs(logits, labels, temperature), self)[:, : L - 1]
        ent = None
        if entropy:
            ent = gather_sequence(entropy_from_logits(logits.float() / temperature), self)[:, : L - 1]
        return lp, ent

    def values(self, critic, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """A `learner.engine.ValueModel`'s values (B, L) of rows (B, L) with this group (grad flows)."""
        L = input_ids.shape[1]
        ids, pos, lo, hi = self._slice_inputs(input_ids, position_ids)
        with self._sharded(critic, pos):
            v = critic(ids[:, lo:hi], None, pos[:, lo:hi])
        return gather_sequence(v, self)[:, :L]

    def _slice_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None):
        """The rows padded to a multiple of `size` (positions go on counting), and this rank's slice."""
        B, L = input_ids.shape
        if position_ids is None:  # a right-padded batch: one document per row
            position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
        width = math.ceil(L / self.size)
        pad = width * self.size - L
        if pad:
            input_ids = F.pad(input_ids, (0, pad))
            tail = position_ids[:, -1:] + torch.arange(1, pad + 1, device=position_ids.device)
            position_ids = torch.cat([position_ids, tail], dim=1)
        return input_ids, position_ids, self.index * width, (self.index + 1) * width

    @contextlib.contextmanager
    def _sharded(self, model, position_ids: torch.Tensor):
        """Run `model`'s attention layers as this group's (its configs name ATTENTION meanwhile)."""
        register()
        configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
                   and hasattr(c, "_attn_implementation")}.values()
        before = [(c, c._attn_implementation) for c in configs]
        _active.update(sp=self, docs=torch.cumsum(position_ids == 0, dim=1))
        try:
            for c, _ in before:
                c._attn_implementation = ATTENTION
            yield
        finally:
            for c, impl in before:
                c._attn_implementation = impl
            _active.clear()

    def check_model(self, config) -> None:
        """Refuse, at start, a model whose heads the group cannot split."""
        heads = getattr(config, "num_attention_heads", None)
        if heads is None or heads % self.size:
            raise ValueError(f"learner.sequence_parallel={self.size} must divide the model's attention heads "
                             f"(num_attention_heads={heads})")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise ValueError(f"learner.sequence_parallel: sliding-window attention (sliding_window="
                             f"{config.sliding_window}) is not supported; use sequence_parallel 1")


# ---- the attention ---------------------------------------------------------------------------------


def register() -> None:
    """Make ATTENTION a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, ulysses_attention)


def ulysses_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (B, H, l, D), key/value (B, Hkv, l, D) of this
    rank's slice -> (B, l, H, D). The mask transformers passes is ignored (it knows only the slice):
    causal within each document of the whole rows, from the ids the sharded forward put aside."""
    if not _active:
        raise RuntimeError(f"attention implementation {ATTENTION!r} called outside a sequence-parallel forward")
    if kwargs.get("sliding_window"):
        raise ValueError("sequence parallelism does not support sliding-window attention")
    sp: SequenceParallel = _active["sp"]
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % sp.size:  # too few key/value heads to split: one copy per query head
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (seq_to_heads(t, sp) for t in (query, key, value))  # (B, h, L, D)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    docs = _active["docs"]  # (B, L)
    L = docs.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    mask = (docs[:, :, None] == docs[:, None, :]) & causal  # (B, L, L)
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None],
                                         dropout_p=dropout if module.training else 0.0, scale=scaling)
    return heads_to_seq(out, sp).transpose(1, 2).contiguous(), None


# ---- collectives with their gradients ----------------------------------------------------------------


def _all_to_all(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """out[j] = rank j's x[index] (dim 0 has `size` entries)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=sp.group)
    return out


def _seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    B, H, l, D = x.shape
    y = _all_to_all(x.reshape(B, sp.size, H // sp.size, l, D).transpose(0, 1), sp)  # (size, B, h, l, D)
    return y.permute(1, 2, 0, 3, 4).reshape(B, H // sp.size, sp.size * l, D)


def _heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    B, h, L, D = x.shape
    y = _all_to_all(x.reshape(B, h, sp.size, L // sp.size, D).permute(2, 0, 1, 3, 4), sp)  # (size, B, h, l, D)
    return y.transpose(0, 1).reshape(B, sp.size * h, L // sp.size, D)


class _Swap(torch.autograd.Function):
    """The position split for the head split (`to_heads`) or back; each is the other's backward."""

    @staticmethod
    def forward(ctx, x, sp, to_heads: bool):
        ctx.sp, ctx.to_heads = sp, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, sp)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.sp), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp, ctx.width = sp, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        # all_gather's backward sums the group's gradients for this slice; every rank computed the
        # same loss from the same rows, so they are equal: size times this rank's own
        lo = ctx.sp.index * ctx.width
        return grad[:, lo: lo + ctx.width] * ctx.sp.size, None


def seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(B, H, l, D) of this rank's positions -> (B, H/size, L, D): every position of its heads."""
    return _Swap.apply(x, sp, True)


def heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The inverse: (B, H/size, L, D) -> (B, H, l, D)."""
    return _Swap.apply(x, sp, False)


def gather_sequence(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(B, l, ...) slices -> (B, L, ...) on every rank of the group."""
    return _GatherSequence.apply(x, sp)
