"""An exponential moving average of the policy's weights (`learner.ema_beta`; OpenRLHF's enable_ema).

After every optimizer step of the policy, ema = beta * ema + (1 - beta) * weights, starting from
the weights the run starts with (OpenRLHF's EMA model is loaded from the same pretrained folder).
The EMA is what a checkpoint's HF model folder holds (`model.safetensors`), as OpenRLHF saves its
EMA model; the weight rounds, evaluations and the DeepSpeed state keep the trained weights.

Kept in fp32 (an update of (1 - beta) * delta is below bf16's resolution) on the parameters'
device. Under ZeRO-3 each rank keeps the EMA of its own partition of every parameter
(`param.ds_tensor`, a slice of the flattened parameter), so the EMA costs 4 bytes a parameter
divided by the ranks and an update moves nothing between them; the partitions are gathered only
to write the HF folder.

Checkpoint `step_N/` also holds `ema/`: `full.pt` (the whole EMA, ZeRO 0-2) or `rank_R.pt` (each
rank's partitions, ZeRO-3), so a resumed run goes on with the same average. Both are written after
`learner.checkpoint.save_checkpoint` finished the folder; a run killed in between resumes from a
checkpoint without them, and its EMA starts again from the resumed weights (said in the log).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from learner.engine import is_zero3

log = logging.getLogger("conveyor.learner")


class PolicyEMA:
    """The EMA of an engine's parameters (this rank's partitions under ZeRO-3)."""

    def __init__(self, engine, beta: float):
        self.beta = beta
        self.zero3 = hasattr(engine, "zero_optimization_stage") and is_zero3(engine)  # (or a plain module)
        self.shadow = {name: self.local(p).detach().float().clone() for name, p in self.params(engine)}

    @staticmethod
    def params(engine) -> Iterator[tuple[str, torch.Tensor]]:
        return getattr(engine, "module", engine).named_parameters()

    def local(self, p: torch.Tensor) -> torch.Tensor:
        """What this rank holds of parameter p: its partition under ZeRO-3, else p itself."""
        return p.ds_tensor if self.zero3 else p.data

    @torch.no_grad()
    def update(self, engine) -> None:
        """After an optimizer step of `engine`: ema <- beta * ema + (1 - beta) * weights."""
        for name, p in self.params(engine):
            self.shadow[name].lerp_(self.local(p).float(), 1.0 - self.beta)

    @torch.no_grad()
    def full_params(self, engine) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, the whole EMA tensor in p's dtype, on the CPU), on rank 0 only. Collective under
        ZeRO-3 (every rank walks it to the end): each parameter's partitions are gathered."""
        rank0 = dist.get_rank() == 0
        for name, p in self.params(engine):
            ema = self.shadow[name]
            if self.zero3:
                parts = [torch.empty_like(ema) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, ema)  # partition r is the slice r of the flattened parameter
                ema = torch.cat(parts)[: p.ds_numel].view(p.ds_shape)
            if rank0:
                yield name, ema.to("cpu", self.local(p).dtype)

    def save(self, out: Path, engine) -> None:
        """Into checkpoint folder `out` (collective): the EMA's state under `ema/`, and the EMA as
        the HF folder's model.safetensors (in place of the trained weights `save_hf` wrote)."""
        from safetensors.torch import save_file

        rank = dist.get_rank()
        (out / "ema").mkdir(exist_ok=True)
        if self.zero3 or rank == 0:
            state = {"beta": self.beta, "zero3": self.zero3, "world_size": dist.get_world_size(),
                     "shadow": self.shadow}
            torch.save(state, out / "ema" / (f"rank_{rank}.pt" if self.zero3 else "full.pt"))
        tensors = dict(self.full_params(engine))
        if rank == 0:
            tmp = out / "model.safetensors.ema.tmp"
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, out / "model.safetensors")
        dist.barrier()

    def load(self, ckpt: Path) -> bool:
        """The EMA saved in checkpoint `ckpt`; False (the EMA left as it is) when it holds none."""
        path = ckpt / "ema" / (f"rank_{dist.get_rank()}.pt" if self.zero3 else "full.pt")
        if not path.is_file():
            log.warning(f"{ckpt} holds no EMA (saved with learner.ema_beta=0): "
                        "the EMA starts again from the resumed weights")
            return False
        state = torch.load(path, map_location="cpu", weights_only=True)
        if set(state["shadow"]) != set(self.shadow) or state["zero3"] != self.zero3:
            raise RuntimeError(f"{path} holds the EMA of another model or ZeRO layout (ZeRO-3: {state['zero3']}, "
                               f"this run: {self.zero3}); resume with the learner.zero_stage it was saved with")
        for name, t in state["shadow"].items():
            self.shadow[name].copy_(t)
        return True
