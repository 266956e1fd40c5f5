"""Facts read from a model folder's `config.json`, shared by the launcher's device plan and the
engines."""

from __future__ import annotations


def num_experts(config: dict) -> int:
    """Routed experts per mixture-of-experts layer (0 for a dense model), under the key each family
    names them (Mixtral `num_local_experts`, Qwen-MoE `num_experts`, DeepSeek `n_routed_experts`); a
    vision-language model's from its language model's `text_config`."""
    config = config.get("text_config", config)
    return int(config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0)
