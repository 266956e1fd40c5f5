"""What each role process needs of a device, estimated from its model folder (parameter count
from its safetensors headers, else config.json; run.model_params_b when the folder is not on this
machine), gathered with the run's process counts in the `Demand` that the plan lays out
(launch/devices/plan.py). Per device:

    learner rank   ZeRO/Adam: weights (dtype) + gradients (dtype) + Adam (fp32 master when
                   not fp32, m, v), each divided by the ranks from the ZeRO stage that
                   shards it; LoRA: the frozen weights only; a critic the same again;
                   rank 0 also two weight-sync buckets while it sends, and the device slot
                   when an engine shares its GPU (weight_sync.same_host=broadcast drops
                   it); plus ACTIVATION_GB + CONTEXT_GB
    engine         its share of the device (vLLM pre-allocates it), which must hold the
                   weights / TP, one max_model_len sequence of KV cache and ACTIVATION_GB;
                   the weight round's receive area (2 x weight_sync.bucket_mb) and a CUDA
                   context come on top of the share
    scorer         reward model + reference model + teacher (scorer.dtype) + ACTIVATION_GB + CONTEXT_GB
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from common.models import num_experts

GIB = float(1 << 30)
CONTEXT_GB = 0.75  # a CUDA context and the libraries' workspaces, per process and device (outside torch's allocator)
ACTIVATION_GB = 2.0  # activations and temporaries of a forward/backward (gradient checkpointing on for big models)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelSize:
    params: int  # parameter count
    largest: int = 0  # elements of the largest tensor (a weight round's bucket holds it whole)
    layers: int = 0
    kv_bytes_per_token: int = 0  # K and V of every layer for one token, at 2 bytes an element
    source: str = ""  # where the numbers came from


def _safetensors_params(folder: Path) -> tuple[int, int] | None:
    """(parameters, elements of the largest tensor) in a folder's safetensors files, from their
    headers alone (no tensor is read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = largest = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                numel = math.prod(meta.get("shape") or [1])
                total += numel
                largest = max(largest, numel)
    return total, largest


def params_from_config(cfg: dict) -> int:
    """A decoder's parameter count from its config.json (Llama, Qwen, Mistral and their MoE kin):
    embeddings, attention, (gated) MLP or routed experts, norms, the LM head unless tied."""
    cfg = cfg.get("text_config", cfg)  # a vision-language model: its language model
    h, n_layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg.get("num_attention_heads", 1)
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2  # q, o; k, v
    experts = num_experts(cfg)
    inter = cfg.get("intermediate_size", 4 * h)
    if experts:
        moe_inter = cfg.get("moe_intermediate_size") or inter
        shared = cfg.get("shared_expert_intermediate_size") or (cfg.get("n_shared_experts") or 0) * moe_inter
        mlp = experts * 3 * h * moe_inter + h * experts + 3 * h * shared
    else:
        mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h
    head = 0 if cfg.get("tie_word_embeddings", False) else vocab * h
    return vocab * h + n_layers * per_layer + h + head


def model_size(folder: str, params_b: float = 0.0) -> ModelSize | None:
    """The size of the model in `folder`; `params_b` (billions) when given wins. None when neither
    the folder nor `params_b` tells (the memory check is then skipped, and the plan says so)."""
    path = Path(folder) if folder else None
    cfg = {}
    if path is not None and (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    layers = int(text.get("num_hidden_layers", 0) or 0)
    kv_per_token = 0
    if layers:
        heads = text.get("num_attention_heads", 1)
        kv = text.get("num_key_value_heads") or heads
        hd = text.get("head_dim") or text["hidden_size"] // heads
        kv_per_token = 2 * layers * kv * hd * 2
    embedding = int(text.get("vocab_size", 0) or 0) * int(text.get("hidden_size", 0) or 0)
    if params_b:
        return ModelSize(int(params_b * 1e9), embedding, layers, kv_per_token, "run.model_params_b")
    if path is None or not path.is_dir():
        return None
    found = _safetensors_params(path)
    if found:
        return ModelSize(found[0], found[1], layers, kv_per_token, "safetensors headers")
    if cfg:
        try:
            return ModelSize(params_from_config(cfg), embedding, layers, kv_per_token, "config.json")
        except KeyError:
            return None
    return None


@dataclass(frozen=True)
class Demand:
    """What a run asks for, read off its config (kept apart so tests can state it directly)."""

    learner_ranks: int
    generators: int
    tp: int
    gpu_scorers: int
    vllm: bool = True
    engine_share: float = 0.0  # generator.gpu_memory_utilization; 0 = decide
    learner_gb: tuple[float, ...] = ()  # per rank, estimated
    learner_parts: str = ""
    slot_gb: float = 0.0  # rank 0's weight-sync device slot, when an engine shares its GPU
    engine_need_gb: float = 0.0  # what an engine's share must hold (per device)
    engine_parts: str = ""
    engine_extra_gb: float = 0.0  # outside the share: receive area, context
    scorer_gb: float = 0.0
    scorer_parts: str = ""
    checked: bool = True
    send_gb: float = 0.0  # rank 0's buckets on the device while it broadcasts (two at most)


def learner_gb(size: ModelSize, ranks: int, zero: int, dtype: str, lora: bool) -> tuple[float, str]:
    """One learner rank's model, gradients and optimizer state in GiB, and how it was counted.

    Mixed precision Adam holds weights (2 B) + gradients (2 B) + fp32 master, m and v (12 B) per
    parameter, 16 B in all (fp32 training: 4 + 4 + 8, also 16); ZeRO-1 shards the optimizer state
    over the ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too. LoRA trains a few adapters:
    the frozen weights alone count."""
    w = DTYPE_BYTES[dtype]
    opt = 8 + (4 if w != 4 else 0)
    p = size.params
    weights = p * w / (ranks if zero >= 3 else 1)
    if lora:
        return weights / GIB, f"weights {weights / GIB:.1f} (LoRA: adapters only trained)"
    grads = p * w / (ranks if zero >= 2 else 1)
    state = p * opt / (ranks if zero >= 1 else 1)
    total = weights + grads + state
    return total / GIB, (f"weights {weights / GIB:.1f} + grads {grads / GIB:.1f} + Adam {state / GIB:.1f} "
                         f"(ZeRO-{zero}, {ranks} rank(s))")


def demand_of(run) -> Demand:
    """The run's demand: process counts from `run:`, sizes from the model folders."""
    r, g, s, l, w = run.run, run.generator, run.scorer, run.learner, run.weight_sync
    # a vLLM engine, or the debugging transformers backend on a CUDA device, takes devices
    vllm = g.engine == "vllm" or str(g.device).startswith("cuda")
    gpu_scorers = r.num_scorers if str(s.device).startswith("cuda") else 0
    policy = model_size(l.model_path, r.model_params_b)
    checked = policy is not None
    lgb, lparts = (0.0, "size unknown")
    slot = 0.0
    if policy is not None:
        lgb, lparts = learner_gb(policy, r.learner_ranks, l.zero_stage, l.dtype, bool(l.lora_rank))
        if l.critic_path:
            critic = model_size(l.critic_path) or policy
            cgb, _ = learner_gb(critic, r.learner_ranks, l.zero_stage, l.dtype, False)
            lgb += cgb
            lparts += f" + critic {cgb:.1f}"
        if w.same_host != "broadcast" and not l.lora_rank:
            slot = policy.params * DTYPE_BYTES[l.dtype] / GIB

    # a weight round's bucket: weight_sync.bucket_mb, or the largest tensor, which travels whole
    bucket = max(w.bucket_mb / 1024, (policy.largest * DTYPE_BYTES[l.dtype] / GIB) if policy else 0.0)
    base = lgb + ACTIVATION_GB + CONTEXT_GB
    lparts += f" + activations {ACTIVATION_GB:.1f} + context {CONTEXT_GB:.2f}"
    per_rank = tuple(base for _ in range(r.learner_ranks))
    engine_need = engine_extra = 0.0
    eparts = ""
    if policy is not None and vllm:
        tp = g.tensor_parallel_size
        weights = policy.params * DTYPE_BYTES[g.dtype] / tp / GIB
        max_len = g.max_model_len or g.prompt_max_len + g.max_new_tokens
        kv = policy.kv_bytes_per_token * max_len / tp / GIB
        engine_need = weights + kv + ACTIVATION_GB
        eparts = (f"weights {weights:.1f} + one {max_len}-token sequence's KV {kv:.2f} "
                  f"+ activations {ACTIVATION_GB:.1f}"
                  if policy.kv_bytes_per_token else f"weights {weights:.1f} + activations {ACTIVATION_GB:.1f} (KV: "
                                                    f"layers unknown without the folder)")

    if vllm:  # the round's two receive areas and the engine's CUDA context, outside its share
        engine_extra = 2 * bucket + CONTEXT_GB
    scorer = 0.0
    sparts = ""
    if gpu_scorers:
        for kind, folder in (("reward model", s.reward_model), ("reference", s.reference), ("teacher", s.teacher)):
            if folder:
                size = model_size(folder) or model_size(l.model_path, r.model_params_b)  # (absent: the policy's size)
                if size is None:
                    checked = False
                    continue
                gb = size.params * DTYPE_BYTES[s.dtype] / GIB
                scorer += gb
                sparts += f"{kind} {gb:.1f} + "
        scorer += ACTIVATION_GB + CONTEXT_GB
        sparts += f"activations {ACTIVATION_GB:.1f} + context {CONTEXT_GB:.2f}"
    return Demand(r.learner_ranks, r.num_generators, g.tensor_parallel_size if vllm else 1, gpu_scorers, vllm,
                  g.gpu_memory_utilization, per_rank, lparts, slot, engine_need, eparts, engine_extra,
                  scorer, sparts, checked, send_gb=2 * bucket)
