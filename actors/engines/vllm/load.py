"""Loading a received round into a running vLLM model at memory speed, without `load_weights`.

vLLM's own way to take new weights, `reload_weights`, restores every layer's checkpoint-format
parameters, runs the model's `load_weights` (name mapping, a copy into fresh tensors) and then
each layer's `process_weights_after_loading` again. Most of that is needed only once: a round
carries the same names and shapes every time. `load_plan` works out once per round where each
received tensor goes, and `apply_plan` puts it there:

- a parameter the kernels read as it is (GPU builds, norms, embeddings) gets a copy into its own
  storage: the received tensor, or its rows of a fused parameter (vLLM's
  `packed_modules_mapping`: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj, the shards
  stacked along dim 0 in the listed order, as `load_weights` stacks them on one tensor-parallel
  rank), or the first rows of a vocabulary padded to a multiple of 64;
- a layer whose kernel computes from a repacked copy of its weight (the CPU build's `cpu_linear`:
  oneDNN, or sgl's packed weights, made by `dispatch_cpu_unquantized_gemm`, which then drops the
  original) is given its new weight and processed again by its own quantisation method, as after
  a checkpoint load: the weight is assembled in a staging tensor the worker keeps between rounds
  (never the receive buffers themselves, which the next round overwrites before it is known to
  succeed: a kernel that keeps a reference to its weight, as zentorch's unpacked path does, must
  not see that). Every such layer is processed again, so a tied LM head follows its embedding.

`load_plan` returns None when a tensor has no such place (a sharded engine, a renamed or
quantised parameter, another dtype). A tensor-parallel engine is the common case: its parameters
hold this rank's shard, not the received full tensor. Then the caller loads through vLLM:

- on a CUDA worker of an unquantised engine, bucket by bucket with the model's own
  `load_weights`: each parameter's `weight_loader` narrows the full tensor to this rank's shard
  and copies it at once (vLLM 0.33 `model_executor/layers/linear.py`,
  `ColumnParallelLinear.weight_loader` / `MergedColumnParallelLinear.weight_loader` /
  `RowParallelLinear.weight_loader`: `loaded_weight.narrow(dim, tp_rank * shard, shard)` then
  `param.data.copy_`; `vocab_parallel_embedding.py`, `VocabParallelEmbedding.weight_loader`: the
  rows of this rank's vocabulary shard). Nothing is kept of the received tensor, so the receive
  area can be reused for the next bucket; and `UnquantizedLinearMethod.process_weights_after_loading`
  changes nothing on CUDA (it repacks on CPU, pads on ROCm), so there is nothing to redo after.
- otherwise with `reload_weights` (vLLM 0.33 `model_executor/model_loader/reload/inplace.py`,
  `reload_weights`, and `layerwise.py`): every layer's parameters go back to the meta device (its
  kernel tensors kept aside), each weight the iterator yields is held (a reference, not a copy:
  `online_process_loader` keeps the loader's arguments) until every element of its layer has
  come, then the layer is materialised on the device in checkpoint format (this rank's shard
  only), loaded, processed again and copied into the kept kernel tensors. Its own extra device
  memory is the layers in progress, but it holds the caller's tensors until their layer is
  complete, so its input must not be a receive area that the next bucket overwrites.
"""

from __future__ import annotations

from typing import NamedTuple


class LoadPlan(NamedTuple):
    dst: list
    """Where each received tensor is copied, in the round's order."""
    rebind: list
    """(layer, tensor): the layer's new weight, set before the layer is processed again."""
    reprocess: list
    """Layers whose kernels read a repacked copy of their weight: processed again after the copy."""


def _repacked(module) -> bool:
    return hasattr(module, "cpu_linear") and hasattr(module, "quant_method")


def load_plan(model, named: list, staging: dict | None = None) -> LoadPlan | None:
    """Where each of `named`'s (HF name, tensor) pairs goes in `model`, or None (see the module's
    docstring). `staging`: the worker's weights of repacked layers, kept between rounds;
    None refuses repacked layers (a plain copy into them would not reach their kernels)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    packed: dict = {}  # (a vision-language model's is its language model's: the outer one's may be empty)
    for m in (*model.modules(), model):
        packed.update(getattr(m, "packed_modules_mapping", None) or {})
    shards = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
    named = vllm_names(model, named)
    sizes = {name: t.shape for name, t in named}
    dst_of, rebind = [], {}
    for name, t in named:
        module, _, leaf = name.rpartition(".")
        parent, _, attr = module.rpartition(".")
        if name in params:
            target, lo, whole = name, 0, tuple(t.shape)
        elif attr in shards:
            fused, i = shards[attr]
            target = f"{parent}.{fused}.{leaf}" if parent else f"{fused}.{leaf}"
            parts = [f"{parent}.{p}.{leaf}" if parent else f"{p}.{leaf}" for p in packed[fused]]
            if target not in params or any(p not in sizes or tuple(sizes[p][1:]) != tuple(t.shape[1:]) for p in parts):
                return None
            lo = sum(sizes[p][0] for p in parts[:i])
            whole = (sum(sizes[p][0] for p in parts), *t.shape[1:])  # every part is in the round
        else:
            return None
        owner_name = target.rpartition(".")[0]
        owner, dst = modules.get(owner_name), params[target]
        if _repacked(owner):
            if staging is None:
                return None
            if dst.numel() == 0 and leaf == "weight":
                # the layer dropped its weight for a repacked copy: a new one, then processed again
                if dst.dtype != t.dtype or whole != _weight_shape(owner):
                    return None
                if target not in staging or tuple(staging[target].shape) != whole:
                    import torch

                    staging[target] = torch.empty(whole, dtype=t.dtype, device=dst.device)
                rebind[owner_name] = (owner, staging[target])
                dst = staging[target]
        if tuple(dst.shape) != whole:
            padded = hasattr(owner, "org_vocab_size")  # vocab rows padded to a multiple of 64
            if not (padded and target == name and dst.shape[1:] == t.shape[1:] and dst.shape[0] >= t.shape[0]):
                return None
            dst = dst[:t.shape[0]]  # load_weights fills these rows; the padding stays as it is
        if dst.dtype != t.dtype:
            return None
        dst_of.append(dst if whole == tuple(t.shape) else dst[lo:lo + t.shape[0]])
    # A vision-language model whose vision tower is frozen gets rounds without it
    # (learner.vision.freeze_vision_tower): its layers keep the weights they have and are left alone.
    left_out = ("visual.",) if not any(name.startswith("visual.") for name, _ in named) else ()
    kept = {n: m for n, m in modules.items() if not (left_out and n.startswith(left_out))}
    if any(_repacked(m) and n not in rebind and getattr(m, "weight", None) is not None and m.weight.numel() == 0
           for n, m in kept.items()):
        return None  # a repacked layer without its weight in the round
    reprocess = [m for m in kept.values() if _repacked(m)] if staging is not None else []
    return LoadPlan(dst_of, list(rebind.values()), reprocess)


def vllm_names(model, named: list) -> list:
    """`named` under the model's own parameter names: a model whose checkpoint names differ from
    its modules' (a vision-language model: `model.layers.` -> `language_model.model.layers.`,
    `lm_head.` -> `language_model.lm_head.`) maps them with its `hf_to_vllm_mapper`, as its
    `load_weights` does; the tensors are the same objects."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return named
    if getattr(mapper, "orig_to_new_stacked", None):
        # renames only: q/k/v_proj -> qkv_proj (vLLM 0.32's `orig_to_new_stacked`) would lose which
        # shard a tensor is; load_plan places shards itself (packed_modules_mapping)
        import dataclasses

        mapper = dataclasses.replace(mapper, orig_to_new_stacked={})
    out = []
    for name, t in named:
        mapped = mapper._map_name(name)
        out.append((name if mapped is None else mapped, t))
    return out


def _weight_shape(layer) -> tuple | None:
    """(out, in) of a linear layer's unsharded-here weight, from the sizes vLLM gave it."""
    out, inp = getattr(layer, "output_size_per_partition", None), getattr(layer, "input_size_per_partition", None)
    return (int(out), int(inp)) if out is not None and inp is not None else None


def apply_plan(plan: LoadPlan, named: list) -> None:
    """Copy each received tensor into its place, give repacked layers their new weights and
    process them again (no allocation but a first round's staging)."""
    copy_plan(plan, named)
    finish_plan(plan)


def copy_plan(plan: LoadPlan, named: list) -> None:
    """The copies of `apply_plan`: each received tensor into its place (or its staging)."""
    import torch

    with torch.no_grad():
        for dst, (_, t) in zip(plan.dst, named, strict=True):
            dst.copy_(t, non_blocking=True)
        if any(d.is_cuda for d in plan.dst):
            torch.cuda.synchronize()


def copy_part(plan: LoadPlan, index: dict, named: list) -> None:
    """The copies of `copy_plan` for some of the round's tensors (one received bucket): `index`
    maps a name to its place in the round's order (the plan's). A plan made from the manifest
    alone (meta tensors of the round's shapes and dtypes) places a streamed round this way."""
    import torch

    with torch.no_grad():
        for name, t in named:
            plan.dst[index[name]].copy_(t, non_blocking=True)


def finish_plan(plan: LoadPlan) -> None:
    """The rest of `apply_plan`, once the copies are known good: repacked layers take their new
    weights and are processed again."""
    import torch

    with torch.no_grad():
        for layer, weight in plan.rebind:
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        for layer in plan.reprocess:
            layer.quant_method.process_weights_after_loading(layer)


def repack_cpu_experts(model) -> int:
    """After `reload_weights` into a mixture of experts on vLLM's CPU build: pack each MoE layer's
    new expert weights into its kernel's layout again. The CPU experts kernel reads w13/w2 prepacked
    for its ISA (`CPUUnquantizedExperts.process_weights_after_loading`: pad, then
    `cpu_prepack_moe_weight`), and the in-place reload leaves them in the checkpoint's layout (seen on
    vLLM 0.32: the engine then computes with garbled experts; tests/system/test_moe.py). Returns the
    layers repacked."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    n = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(getattr(kernel, "impl", None), "fused_experts", None)
        if hasattr(module, "w13_weight") and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            n += 1
    return n
