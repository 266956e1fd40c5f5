"""Merge a LoRA adapter folder into its base model: `python -m launch.lora_combiner` calls `run`.

    base (AutoModelForCausalLM, or with `is_rm` a one-label AutoModelForSequenceClassification)
      + adapter (peft's folder: adapter_config.json, adapter_model.safetensors)
      -> merged: each adapted weight W + (lora_alpha / r) * B @ A, the adapter's other modules
         (a reward model's `score` head) as the adapter saved them
      -> output_path: a plain Hugging Face folder (config, weights, the base's tokenizer)

The adapters the offline trainers write (`<save_path>/adapter/`) and OpenRLHF's both load here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from learner.offline.config import LoraCombineConfig
from learner.offline.rm import load_reward_model


def run(cfg: LoraCombineConfig) -> int:
    """The command's role: `combine`; the exit code."""
    combine(cfg.model_path, cfg.lora_path, cfg.output_path, cfg.is_rm, cfg.dtype)
    return 0


def combine(model_path: str, lora_path: str, output_path: str, is_rm: bool = False,
            dtype: str = "bfloat16") -> Path:
    """Load the base and the adapter, merge, save to `output_path`; returns it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if is_rm:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        base = load_reward_model(model_path, pad_id, torch_dtype)
    else:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    merged = PeftModel.from_pretrained(base, lora_path, torch_dtype=torch_dtype).merge_and_unload()
    out = Path(output_path)
    merged.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
