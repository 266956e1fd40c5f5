"""Packed batches: a micro-batch's right-padded rows repacked into rows without padding, and back.

The RL learner's micro-batch is (B, L), right-padded to its longest sequence; on a batch whose
lengths spread 10x most of it is padding. `pack_rows` moves the sequences into R <= B rows of
capacity C, first-fit decreasing; C is the longest sequence, L, so no row is wider than the padded
batch's and attention, which costs C^2 per row whatever the documents in it, costs R/B of the
padded batch's. (One row of everything would cost attention quadratic in the whole micro-batch;
capacities up to 2L save a few per cent of the positions but give the saving back in attention:
measured with bench/packing.py.)

Which rows share a micro-batch does not change a mini-batch's gradient (the micro-batches'
gradients are summed, and every loss is normalised by the whole mini-batch's counts), so with
packing the learner first re-deals each mini-batch's rows over its micro-batches (`regroup`): all
of them first-fit decreasing into rows of the longest, then whole rows to the micro-batch with the
fewest tokens so far. Each micro-batch then packs nearly without a gap, and all carry about the
same tokens.

    padded (B=4, L=6)          packed (R=3, C=6)          position ids
    a a a a a a                a a a a a a                0 1 2 3 4 5
    b b . . . .                c c c b b .                0 1 2 0 1 0
    c c c . . .                d d . . . .                0 1 0 1 2 3   <- a row's tail: a padding
    d d . . . .                                                            "document" of its own

Position ids restart at 0 for every sequence and the model gets no attention mask: transformers
then reads each row as packed documents and keeps attention inside each one
(`masking_utils.find_packed_sequence_indices`, in every attention implementation it builds masks
for, and only with no cache; tests/learner/test_packing.py checks a packed forward against each
sequence's own). The leftover tail of a row counts 0, 1, ... too, so no sequence sees it.

Every per-position output of the packed forward maps back to the padded frame with `unpack`
((R, C, ...) -> (B, L, ...)) or, for next-token outputs, `unpack_next` ((R, C-1, ...) ->
(B, L-1, ...)), so losses, advantages and metrics never see the packing. Positions of the padded
frame that hold no prediction (padding, and a sequence's last token, whose packed neighbour is the
next sequence's first) come back as 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each holding at most `capacity` in total; the longest items go first,
    each into the first bin it fits in. An item longer than `capacity` gets a bin of its own."""
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def regroup(lengths: list[int], groups: list[torch.Tensor]) -> list[torch.Tensor]:
    """The rows of `groups` (index tensors into `lengths`, e.g. one mini-batch's micro-batches)
    dealt into as many groups that pack tightly (module docstring) into rows of their longest
    length (pass it to `pack_rows` as the capacity); every group keeps at least one row. With
    fewer packed rows than groups, `groups` unchanged."""
    rows = torch.cat(groups)
    sub = [lengths[i] for i in rows.tolist()]
    bins = sorted(first_fit_decreasing(sub, max(sub)), key=lambda b: -sum(sub[i] for i in b))
    if len(bins) < len(groups):
        return groups
    dealt: list[list[int]] = [[] for _ in groups]
    load = [0] * len(groups)
    for b in bins:  # longest processing time first: the fullest rows go out first, each to the lightest group
        g = load.index(min(load))
        dealt[g].extend(b)
        load[g] += sum(sub[i] for i in b)
    return [rows[torch.tensor(sorted(d), dtype=torch.long)] for d in dealt]


@dataclass
class PackedRows:
    """A padded (B, L) batch repacked into (R, C) rows; `unpack*` map outputs back."""

    input_ids: torch.Tensor  # (R, C) long
    position_ids: torch.Tensor  # (R, C) long, restarting at 0 per sequence (and per row tail)
    shape: tuple[int, int]  # (B, L) of the padded batch
    packed_index: torch.Tensor  # (N,) flat index into R * C of every real token
    padded_index: torch.Tensor  # (N,) flat index into B * L of the same token
    predicts: torch.Tensor  # (N,) bool: the token is not its sequence's last (its logits predict one of it)

    @property
    def num_slots(self) -> int:
        """Positions the packed forward computes (R * C), padding of the row tails included."""
        return self.input_ids.numel()

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(R, C, ...) per packed position -> (B, L, ...) per padded position, 0 at padding (grad flows)."""
        R, C = self.input_ids.shape
        B, L = self.shape
        vals = x.reshape(R * C, *x.shape[2:])[self.packed_index]  # (N, ...)
        out = x.new_zeros((B * L, *x.shape[2:])).index_put((self.padded_index,), vals)
        return out.view(B, L, *x.shape[2:])

    def unpack_next(self, x: torch.Tensor) -> torch.Tensor:
        """(R, C-1, ...) next-token outputs (position p predicts packed token p + 1) -> (B, L-1, ...),
        0 where the padded frame predicts no token of the sequence (grad flows)."""
        R, C = self.input_ids.shape
        B, L = self.shape
        rest = x.shape[2:]
        full = torch.cat([x, x.new_zeros((R, 1, *rest))], dim=1)  # (R, C, ...): the last slot predicts nothing
        vals = full.reshape(R * C, *rest)[self.packed_index]  # (N, ...)
        keep = self.predicts.view(-1, *([1] * len(rest)))
        vals = torch.where(keep, vals, torch.zeros((), dtype=vals.dtype, device=vals.device))
        out = x.new_zeros((B * L, *rest)).index_put((self.padded_index,), vals)
        return out.view(B, L, *rest)[:, :-1]


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int | None = None) -> PackedRows:
    """Right-padded (B, L) ids and mask -> `PackedRows`: first-fit decreasing into rows of
    `capacity` tokens (default: the longest sequence). Rows are as wide as the fullest one."""
    B, L = input_ids.shape
    device = input_ids.device
    lengths = attention_mask.sum(-1).tolist()  # the one host sync of the packing
    if min(lengths) <= 0:
        raise ValueError(f"cannot pack an empty sequence (lengths {lengths})")
    bins = first_fit_decreasing(lengths, capacity or max(lengths))
    used = [sum(lengths[i] for i in b) for b in bins]
    R, C = len(bins), max(used)

    row, offset = [0] * B, [0] * B
    for r, b in enumerate(bins):
        start = 0
        for i in b:
            row[i], offset[i] = r, start
            start += lengths[i]
    n = torch.tensor(lengths, device=device)  # (B,)
    N = int(sum(lengths))
    first = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)  # (N,) index of each token's sequence start
    within = torch.arange(N, device=device) - first  # (N,) position inside its sequence
    seq_start = torch.tensor(row, device=device) * C + torch.tensor(offset, device=device)  # (B,)
    packed_index = torch.repeat_interleave(seq_start, n) + within
    padded_index = torch.repeat_interleave(torch.arange(B, device=device) * L, n) + within

    ids = torch.zeros(R * C, dtype=input_ids.dtype, device=device)
    ids[packed_index] = input_ids.reshape(-1)[padded_index]
    # the tail of row r (slots >= used[r]) counts 0, 1, ...: a padding document of its own
    pos = (torch.arange(C, device=device)[None] - torch.tensor(used, device=device)[:, None]).reshape(-1)  # (R*C,)
    pos[packed_index] = within
    return PackedRows(input_ids=ids.view(R, C), position_ids=pos.view(R, C), shape=(B, L),
                      packed_index=packed_index, padded_index=padded_index,
                      predicts=within < torch.repeat_interleave(n, n) - 1)
