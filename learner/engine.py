"""DeepSpeed setup shared by the RL learner and the offline trainers: the process group, the model
loading, the config dict, the engines (policy, critic, any model), and full-parameter gathering.

With `lora_rank > 0` the policy (and an offline trainer's model) is a peft LoRA model whose
adapters alone are trainable, so DeepSpeed's optimizer holds only them (`learner/lora.py`); what a
weight round sends is then the adapter (`iter_publish_params`). Checked on CPU with ZeRO 0, 2
and 3.

Checked on CPU (DeepSpeed 0.19.8, torch 2.13 CPU, gloo): ZeRO 0-3 with `torch.optim.AdamW` passed
to `deepspeed.initialize` (no compiled CPU Adam needed), two ranks under either
`deepspeed --num_gpus 2` or `torchrun --nproc_per_node 2`. The first `init_distributed` on a
machine compiles DeepSpeed's shared-memory comm op (~40 s, cached under ~/.cache/torch_extensions).

ZeRO-3 note: models are loaded whole on every rank and partitioned by `deepspeed.initialize`
(`deepspeed.zero.Init` through transformers needs `accelerate`, which this stack does not ship);
fine for models that fit in each rank's host memory.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn

from learner.config import LearnerConfig

_SET_LOCAL_RANK = [False]


def init_distributed(cfg: LearnerConfig) -> tuple[int, int, torch.device]:
    """Join (or, alone, create) the default process group. Returns (rank, world_size, device).

    Under a launcher (deepspeed, torchrun) the environment names the rank and the rendezvous. A
    process started with plain `python` is a world of one: its group lives in an in-memory store
    (no port, nothing in os.environ but the LOCAL_RANK DeepSpeed insists on), so the learner can
    run inside another program, e.g. a test. That group stays for the life of the process
    (DeepSpeed caches it), and a second `run` there reuses it.
    """
    import deepspeed
    import torch.distributed as dist

    backend = cfg.dist_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        from learner.modeling import apply_memory_share, cuda_index

        index = cuda_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
        torch.cuda.set_device(index)
        apply_memory_share(f"cuda:{index}")
    if not dist.is_initialized() and "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.is_initialized() and dist.get_world_size() == 1 and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = "0"  # deepspeed.initialize asserts it is set
        _SET_LOCAL_RANK[0] = True
    # bounds the rendezvous (a rank that never comes) and every collective: past it, an error names the op
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=cfg.dist_timeout_s))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def shutdown_distributed() -> None:
    """Undo what `init_distributed` put in os.environ for a world of one (the group itself stays)."""
    if _SET_LOCAL_RANK[0]:
        os.environ.pop("LOCAL_RANK", None)
        _SET_LOCAL_RANK[0] = False


@contextmanager
def process_group(cfg) -> Iterator[tuple[int, int, torch.device]]:
    """`with process_group(cfg) as (rank, world, device):` init_distributed, undone however the block ends.

    `cfg` needs `dist_backend` and `dist_timeout_s` (a LearnerConfig, or an offline trainer's)."""
    rank, world, device = init_distributed(cfg)
    try:
        yield rank, world, device
    finally:
        shutdown_distributed()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over the ranks (a copy; `t` is left as it is). Collective."""
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def stopped(stop, world: int, device: torch.device) -> bool:
    """Whether the `threading.Event` `stop` is set on any rank, so that every rank stops at the same
    step (collective when there are several ranks and a `stop` at all)."""
    if stop is None:
        return False
    if world == 1:
        return stop.is_set()
    return bool(all_reduce_sum(torch.tensor([float(stop.is_set())], device=device)).item())


def deepspeed_config(cfg: LearnerConfig) -> dict:
    """The DeepSpeed config dict for LearnerConfig (the optimizer and schedule are passed as objects)."""
    return {
        # DeepSpeed only uses the micro-batch size for bookkeeping; our micro-batches are split by count
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def lr_lambda(cfg: LearnerConfig, total_updates: int):
    """Multiplier of the peak lr after `n` optimizer steps: linear warm-up, then constant / linear / cosine."""
    warmup = cfg.warmup_steps
    floor = cfg.min_lr_ratio

    def f(n: int) -> float:
        if n < warmup:
            return (n + 1) / (warmup + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (n - warmup) / max(1, total_updates - warmup))
        if cfg.lr_schedule == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _initialize(model: nn.Module, cfg: LearnerConfig, lr: float):
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay)
    total_updates = cfg.total_steps * cfg.updates_per_step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_updates))
    # on CUDA, the device this rank took (`init_distributed`): DeepSpeed would otherwise set the
    # device from LOCAL_RANK again (runtime/engine.py `_set_distributed_vars`), an ordinal that a
    # rank given one GPU of its own does not have
    args = argparse.Namespace(device_rank=torch.cuda.current_device()) if torch.cuda.is_initialized() else None
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg))
    return engine


def build_engine(model: nn.Module, cfg: LearnerConfig, lr: float | None = None):
    """Any model wrapped in a DeepSpeed engine with AdamW and cfg's LR schedule (the offline trainers'
    policy or reward model); total updates = cfg.total_steps * cfg.updates_per_step. With
    cfg.lora_rank > 0 the model gets LoRA adapters first, and only they are trained."""
    return _initialize(with_lora(model, cfg), cfg, cfg.lr if lr is None else lr)


def with_lora(model: nn.Module, cfg) -> nn.Module:
    """`model` with LoRA adapters when cfg.lora_rank > 0 (see learner/lora.py), else as it is."""
    if not cfg.lora_rank:
        return model
    from learner.lora import apply_lora

    return apply_lora(model, cfg)


def enable_gradient_checkpointing(model: nn.Module, on: bool = True) -> nn.Module:
    """HF gradient checkpointing (non-reentrant) when `on`; returns the model.

    transformers checkpoints a layer only in training mode (`GradientCheckpointingLayer.__call__`:
    `self.gradient_checkpointing and self.training`), and `from_pretrained` returns a model in eval
    mode, which the learner keeps (no dropout: pi_old and the trained forward must compute the
    same function). So the checkpointed layers alone are marked as training, not their submodules:
    their activations are recomputed in the backward, and every dropout stays off."""
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for module in model.modules():
            checkpointed = module.__dict__.get("gradient_checkpointing") is True
            if checkpointed and hasattr(module, "_gradient_checkpointing_func"):
                module.training = True  # (not .train(): that would switch its dropouts on)
    return model


def load_trainable_lm(path: str, gradient_checkpointing: bool = False) -> nn.Module:
    """Any AutoModelForCausalLM folder in fp32, set up to be trained (no KV cache): the RL policy,
    and the SFT and DPO policies. bf16 training casts it inside DeepSpeed."""
    from learner.vision import auto_model_class

    model = auto_model_class(path).from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return enable_gradient_checkpointing(model, gradient_checkpointing)


def build_policy_engine(cfg: LearnerConfig):
    """The policy (any AutoModelForCausalLM folder) wrapped in a DeepSpeed engine with AdamW
    (with LoRA adapters, the only trainable parameters, when cfg.lora_rank > 0). A mixture of
    experts with `freeze_router` keeps its routers as they are; a vision-language policy with
    `freeze_visual_encoder` its vision tower."""
    model = load_trainable_lm(cfg.model_path, cfg.gradient_checkpointing)
    if cfg.freeze_router:
        from learner.moe import freeze_routers

        freeze_routers(model)
    if cfg.freeze_visual_encoder:
        from learner.vision import freeze_vision_tower

        freeze_vision_tower(model)
    return build_engine(model, cfg)


class ValueModel(nn.Module):
    """A critic: a transformer backbone (`AutoModel`, the causal LM without its head) + a linear value head.

    forward(input_ids, attention_mask) -> values (B, L): the value of the state after each position.
    forward(input_ids, None, position_ids) runs on packed rows (`learner.packing`): positions
    restarting at 0 keep each sequence's attention to itself, as for the policy.
    """

    def __init__(self, path: str):
        super().__init__()
        from transformers import AutoModel

        self.backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
        self.backbone.config.use_cache = False
        self.value_head = nn.Linear(self.backbone.config.hidden_size, 1)
        # start from V = 0 everywhere: the first advantages are then the plain returns
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()  # (B, L)


def build_critic_engine(cfg: LearnerConfig):
    """The critic for PPO's GAE, trained on the same ranks with its own AdamW (lr = critic_lr)."""
    model = ValueModel(cfg.critic_path or cfg.model_path)
    enable_gradient_checkpointing(model.backbone, cfg.gradient_checkpointing)
    return _initialize(model, cfg, cfg.critic_lr)


def is_zero3(engine) -> bool:
    return engine.zero_optimization_stage() == 3


def grad_norm(engine) -> float:
    """The global gradient norm of the engine's last optimizer step; NaN when DeepSpeed did not compute it."""
    x = engine.get_global_grad_norm()
    if x is None:
        return float("nan")
    return float(x.item() if hasattr(x, "item") else x)


def iter_full_params(engine, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full CPU tensor) for every parameter of the engine's model, yielded on rank 0 only.

    `copy=False`: each tensor is valid only until the next is asked for (the parameter itself, or
    under ZeRO-3 its gathered form, on the engine's device), for a consumer that copies it at once,
    as the weight sender does into its buckets.

    Under ZeRO-3 each parameter is gathered from its partitions first, which is a collective:
    every rank must walk this iterator to the end (the others get nothing), in step with rank 0.
    Names are the module's own (`model.layers.0.self_attn.q_proj.weight`, ...), i.e. HF naming
    for a policy loaded with AutoModelForCausalLM. A LoRA model's full weights are its merged
    ones (`learner.lora.iter_merged_params`), under the same names.
    """
    import deepspeed
    import torch.distributed as dist

    from learner.lora import is_lora, iter_merged_params

    if is_lora(engine):
        yield from iter_merged_params(engine)
        return

    rank0 = dist.get_rank() == 0
    zero3 = is_zero3(engine)
    for name, p in engine.module.named_parameters():
        if zero3:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if rank0:
                    yield name, p.detach().to("cpu", copy=True) if copy else p.detach()
        elif rank0:
            yield name, p.detach().to("cpu", copy=True) if copy else p.detach()


def iter_publish_params(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """What a weight round sends: the LoRA adapter's tensors for a LoRA policy (peft's names, see
    `learner.lora.iter_adapter_params`), else every parameter (`iter_full_params`). Rank 0 gets
    them; every rank walks the iterator to the end. `learner.lora.adapter_spec(engine)` says
    which it is. Each tensor is valid only until the next is asked for (the sender copies it)."""
    from learner.lora import is_lora, iter_adapter_params, sends_merged

    if is_lora(engine) and not sends_merged(engine):
        return iter_adapter_params(engine)
    named = in_checkpoint_layout(engine, iter_full_params(engine, copy=False))
    if vision_tower_fixed(engine):  # (its weights are the engines' already: never sent)
        from learner.vision import is_vision_name

        return ((n, t) for n, t in named if not is_vision_name(n))
    return named


def vision_tower_fixed(engine) -> bool:
    """Whether the policy is a vision-language model whose vision tower never trains: frozen
    (learner.freeze_visual_encoder), or a LoRA policy's (its adapters are on the language model)."""
    from learner.moe import causal_lm
    from learner.vision import vision_parameters

    params = vision_parameters(causal_lm(engine))
    return bool(params) and not any(p.requires_grad for _, p in params)


def in_checkpoint_layout(engine, named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` (the model's parameters, as transformers holds them in memory) under the names and in
    the layout of the model's checkpoint files, which the engines load: transformers 5 fuses some
    checkpoint tensors when it loads them (a mixture of experts' per-expert weights into 3-D
    `experts.gate_up_proj`/`down_proj`; Mixtral's `block_sparse_moe` renamed `mlp`) and undoes it
    when it saves (`revert_weight_conversion`, what `save_pretrained` calls). Each parameter is
    converted on its own (tests/learner/test_moe.py: the union is the checkpoint, key for key and
    value for value); a model without conversions passes through as it is (a Llama: about 0.1 ms a
    parameter)."""
    from transformers.core_model_loading import revert_weight_conversion

    from learner.moe import causal_lm

    model = causal_lm(engine)
    for name, t in named:
        yield from revert_weight_conversion(model, {name: t}).items()
