"""Generation engines: what a generator drives to sample completions and to load new weights.

Reading order: `build_engine` below (a backend by name), `base.py` (the `Engine` interface,
`Sampling`, `Completion`), then a backend: `vllm/` (the production backend) or `hf.py` (a plain
transformers model sampled by hand: slow, for debugging and for machines without vLLM).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.engines.base import Engine

# The backends are imported when first used: importing vLLM takes seconds and starts its platform checks.

def build_engine(cfg) -> Engine:
    """The engine a `GeneratorConfig` asks for."""
    if cfg.engine == "vllm":
        from actors.engines.vllm.engine import AsyncVLLMEngine, VLLMEngine

        cls = AsyncVLLMEngine if cfg.async_engine else VLLMEngine
        return cls(cfg.model, tokenizer=cfg.tokenizer, dtype=cfg.dtype, seed=cfg.seed,
                   tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
                   max_model_len=cfg.max_model_len, worker_extension=cfg.worker_extension, lora_rank=cfg.lora_rank,
                   cpu_linear=cfg.cpu_linear, record_routes=cfg.record_routes,
                   max_images_per_prompt=cfg.max_images_per_prompt)
    elif cfg.engine == "transformers":
        from actors.engines.hf import TransformersEngine

        return TransformersEngine(cfg.model, tokenizer=cfg.tokenizer, dtype=cfg.dtype, seed=cfg.seed,
                                  device=cfg.device)
    raise ValueError(f"generator.engine={cfg.engine!r} is not 'vllm' or 'transformers'")


_BACKENDS = {"VLLMEngine": "actors.engines.vllm.engine", "AsyncVLLMEngine": "actors.engines.vllm.engine",
             "extension_available": "actors.engines.vllm.engine", "TransformersEngine": "actors.engines.hf"}


def __getattr__(name: str):
    """The backends' names, from their modules on first use (`from actors.engines import VLLMEngine`)."""
    module = _BACKENDS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
