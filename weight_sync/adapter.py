"""Adapter rounds: a round whose `RoundInfo.adapter` is set carries a LoRA adapter (peft's tensor
names, of learner rank 0's adapter), not the full weights.

vLLM loads it as an adapter from the folder `write_adapter` fills (peft's format:
`actors/engines/vllm/worker.py`); a plain torch model gets it merged into its weights
(`merge_adapter`: base + scale * B @ A, from the base weights it kept at the first adapter round;
`receiver.receive_into_model` calls it).
"""

from __future__ import annotations

import os
from typing import Any

from weight_sync.messages import Adapter

PEFT_PREFIX = "base_model.model."


def write_adapter(named: list, adapter: Adapter, folder: str) -> str:
    """An adapter round's tensors as peft's format in `folder` (adapter_config.json and
    adapter_model.safetensors, each written whole, then renamed into place); returns `folder`."""
    import json

    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.r, "lora_alpha": adapter.lora_alpha,
              "target_modules": list(adapter.target_modules), "bias": "none", "lora_dropout": 0.0}
    tmp = os.path.join(folder, f"adapter_model.safetensors.tmp{os.getpid()}")
    # clone: safetensors refuses tensors that share storage (the views share their bucket)
    save_file({n: t.clone() for n, t in named}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, "adapter_model.safetensors"))
    with open(tmp, "w") as f:
        json.dump(config, f)
    os.replace(tmp, os.path.join(folder, "adapter_config.json"))
    return folder


def adapter_modules(named: list) -> dict[str, dict[str, Any]]:
    """An adapter round's tensors by module: `{"model.layers.0.mlp.up_proj": {"A": (r, in), "B": (out, r)}}`."""
    out: dict[str, dict[str, Any]] = {}
    for name, t in named:
        module, sep, part = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise KeyError(f"adapter tensor {name!r} is not a LoRA A or B weight")
        out.setdefault(module, {})[part[0]] = t
    return out


def merge_adapter(model, named: list, adapter: Adapter, base: dict) -> int:
    """Set every adapted weight of `model` to base + scale * B @ A; `base` (the caller's, kept
    between rounds) gets the original weights at the first call. Returns the weights set."""
    import torch

    modules = dict(model.named_modules())
    adapted = adapter_modules(named)
    with torch.no_grad():
        for name, ab in adapted.items():
            if name not in modules or set(ab) != {"A", "B"}:
                raise KeyError(f"adapter module {name!r}: not in the model, or without both A and B")
            weight = modules[name].weight
            w0 = base.setdefault(name, weight.detach().clone())
            delta = ab["B"].to(weight.device, torch.float32) @ ab["A"].to(weight.device, torch.float32)  # (out, in)
            weight.copy_((w0.float() + adapter.scale * delta).to(weight.dtype))
    return len(adapted)
