"""LoRA (peft) for the RL learner and the offline trainers: the adapters, what a weight round sends,
the merged weights, and the reference log-probs of the frozen base.

With `lora_rank > 0` (OptimConfig) the model is wrapped by `peft.get_peft_model`: adapters of rank
r on `lora_target_modules` (`all-linear`: every linear layer but the output head), scaled by
lora_alpha / r, and only the adapters are trainable (DeepSpeed's AdamW sees only them). Then:

- a weight round sends the adapter alone (`iter_adapter_params`: peft's own file names and
  tensors, `base_model.model.<module>.lora_A.weight`), with its `adapter_spec` (rank, alpha,
  modules); the generator loads it as a LoRA adapter into vLLM, or merges it by hand in the
  transformers backend (`actors/engines/vllm/worker.py`, `weight_sync.adapter.merge_adapter`);
- checkpoints hold the adapter in peft's format (`save_adapter`) and, on request, the merged
  model as a plain HF folder (`iter_merged_params`: base + scale * B @ A under the base names);
- the reference model of the KL term is the same model with the adapter switched off
  (`reference_logprobs`): no second copy of the base.

Under ZeRO-3 the parameters a function reads are gathered first: a collective, so every rank
calls it (only rank 0 gets tensors from the iterators).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.nn as nn

ADAPTER = "default"  # peft's name for the one adapter
PREFIX = "base_model.model."  # what peft puts before the wrapped model's own parameter names


# the language model's linear layers of a Qwen2-VL-class model (peft matches a string as a regex)
VISION_LM_LINEAR = r".*language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"


def apply_lora(model: nn.Module, cfg) -> nn.Module:
    """`model` with LoRA adapters as `cfg` (an OptimConfig) says; only they are trainable.

    A model with a `score` head (the reward model) is a sequence classifier: its head, new and
    randomly initialised, is trained in full beside the adapters (peft's SEQ_CLS task)."""
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target_modules
    all_linear = "all-linear"
    if targets == ["all-linear"] and hasattr(model.config, "vision_config"):
        # a vision-language model: the language model's linear layers only (the vision tower is
        # trained in full or frozen: learner.freeze_visual_encoder)
        all_linear = VISION_LM_LINEAR
    config = LoraConfig(
        r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
        target_modules=all_linear if targets == ["all-linear"] else list(targets),
        task_type="SEQ_CLS" if hasattr(model, "score") else "CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # peft names the modules it could not find
        raise ValueError(f"lora_target_modules={targets}: {e}") from None


def is_lora(model: nn.Module) -> bool:
    """Whether `model` (or a DeepSpeed engine's module) is a peft model."""
    from peft import PeftModel

    return isinstance(getattr(model, "module", model), PeftModel)


def sends_merged(model: nn.Module) -> bool:
    """A LoRA policy whose weight rounds carry its merged weights, not the adapter: one whose adapter
    wraps parameters as well as linear layers (peft's `target_parameters`: a mixture of experts'
    3-D expert weights and router), which the engines do not take as an adapter (vLLM's CPU build
    has no LoRA kernels for fused-MoE layers at all), and a vision-language policy's."""
    model = getattr(model, "module", model)
    if is_lora(model) and hasattr(model.get_base_model().config, "vision_config"):
        return True  # a vision-language policy: the engines serve no adapters for it (merged rounds)
    return is_lora(model) and bool(getattr(model.peft_config[ADAPTER], "target_parameters", None))


def adapter_spec(model: nn.Module) -> dict | None:
    """What a receiver needs besides the tensors to build the adapter: `{"r", "lora_alpha",
    "target_modules"}` (the modules peft actually wrapped); None for a model without LoRA, or
    whose rounds carry merged weights (`sends_merged`)."""
    model = getattr(model, "module", model)
    if not is_lora(model) or sends_merged(model):
        return None
    config = model.peft_config[ADAPTER]
    modules = config.target_modules
    return {"r": int(config.r), "lora_alpha": int(config.lora_alpha),
            "target_modules": sorted(modules) if not isinstance(modules, str) else [modules]}


def _gathered(params: list[nn.Parameter]):
    """Full tensors of `params` inside the block (ZeRO-3 partitions gathered, a collective)."""
    if params and hasattr(params[0], "ds_id"):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return nullcontext()


def _rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def iter_adapter_params(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full CPU tensor) of the adapter, under the names peft writes in
    adapter_model.safetensors (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`;
    a reward model's fully trained head too). Rank 0 gets them; every rank walks the iterator to
    the end (ZeRO-3 gathers)."""
    from peft.utils import get_peft_model_state_dict

    model = getattr(engine, "module", engine)
    rank0 = _rank0()
    trained = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            with _gathered([p]):
                if rank0:
                    trained[name] = p.detach().to("cpu", copy=True)
    if rank0:  # the adapter is small: gathered whole, then renamed by peft itself
        yield from get_peft_model_state_dict(model, state_dict=trained, adapter_name=ADAPTER).items()


def iter_merged_params(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full CPU tensor) of the merged model: every adapted weight as base + scale * B @ A,
    every other parameter as it is, under the wrapped model's own names (what AutoModel and vLLM
    load). Rank 0 gets them; every rank walks the iterator to the end (ZeRO-3 gathers)."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    model = getattr(engine, "module", engine)
    rank0 = _rank0()
    done: set[int] = set()
    for mod_name, module in model.named_modules():
        name = mod_name.removeprefix(PREFIX)
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            # a parameter wrapper (peft's target_parameters: a mixture of experts' 3-D expert weights,
            # nested one per parameter, `experts.base_layer...`) adapts `parameter_name` of the innermost
            param_name = getattr(module, "parameter_name", "weight")
            weight = getattr(base, param_name) if param_name != "weight" else base.weight
            weight = getattr(weight, "original", weight)  # (under peft's parametrization)
            name = name.replace(".base_layer", "")
            params = [weight, *module.lora_A[ADAPTER].parameters(), *module.lora_B[ADAPTER].parameters()]
            with _gathered(params):
                if rank0:
                    merged = weight.detach() + module.get_delta_weight(ADAPTER).detach()
                    yield f"{name}.{param_name}", merged.to("cpu", weight.dtype, copy=True)
            if param_name != "weight":
                done.update(id(p) for p in module.lora_A[ADAPTER].parameters())
                done.update(id(p) for p in module.lora_B[ADAPTER].parameters())
                done.add(id(weight))
                continue
            if getattr(base, "bias", None) is not None:
                with _gathered([base.bias]):
                    if rank0:
                        yield f"{name}.bias", base.bias.detach().to("cpu", copy=True)
            done.update(id(p) for p in module.parameters())
        elif isinstance(module, ModulesToSaveWrapper):
            trained = module.modules_to_save[ADAPTER]
            for p_name, p in trained.named_parameters():
                with _gathered([p]):
                    if rank0:
                        yield f"{name}.{p_name}", p.detach().to("cpu", copy=True)
            done.update(id(p) for p in module.parameters())
    for p_name, p in model.named_parameters():
        if id(p) in done:
            continue
        done.add(id(p))
        with _gathered([p]):
            if rank0:
                yield p_name.removeprefix(PREFIX), p.detach().to("cpu", copy=True)


def save_adapter(engine, out) -> None:
    """The adapter in peft's format (adapter_config.json + adapter_model.safetensors) in `out`,
    written by rank 0; collective under ZeRO-3."""
    from safetensors.torch import save_file

    model = getattr(engine, "module", engine)
    state = dict(iter_adapter_params(engine))
    if not _rank0():
        return
    out.mkdir(parents=True, exist_ok=True)
    config = model.peft_config[ADAPTER]
    config.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})


@contextmanager
def adapter_disabled(engine):
    """Inside the block the model computes with its base weights only (the adapters are skipped)."""
    with getattr(engine, "module", engine).disable_adapter():
        yield


@torch.no_grad()
def reference_logprobs(policy_engine, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       temperature: float = 1.0, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, L-1) token log-probs of the frozen base model (the LoRA policy with its adapter
    disabled): the reference of the KL term, with no second copy of the base. The same function
    as the policy's (`learner.modeling.token_logprobs`), so the two are comparable token by token;
    under ZeRO-3 every rank calls it (the forward gathers parameters). `position_ids`: as for
    `token_logprobs` (packed rows)."""
    from learner.modeling import token_logprobs

    was_training = policy_engine.training
    policy_engine.eval()  # no dropout, as in a reference scorer's model
    try:
        with adapter_disabled(policy_engine):
            return token_logprobs(policy_engine, input_ids, attention_mask, position_ids, temperature)
    finally:
        policy_engine.train(was_training)
