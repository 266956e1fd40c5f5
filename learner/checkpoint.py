"""Checkpoints: `<run_dir>/checkpoints/step_N/`, N = steps done = the policy version of the weights.

A folder holds
  config.json, model.safetensors, generation_config.json, tokenizer files   HF format (transformers, vLLM)
  adapter/          LoRA only: the adapter in peft's format (adapter_config.json, adapter_model.safetensors)
  deepspeed/        engine.save_checkpoint of the policy (optimizer, LR schedule, ZeRO partitions)
  critic/           the same for the critic (PPO with GAE only)
  trainer_state.json  {"step": N, ...}: the next step to train and ask the buffer for, and the
                    loop's own state (`extra`: the RL learner's adaptive KL coefficient)
and `<run_dir>/checkpoints/latest` names the newest complete one; it is written last, so a run
killed while saving resumes from the previous checkpoint. A folder without trainer_state.json is
never resumed from. A save that meets a full disk raises `common.disk.OutOfDisk` naming the folder,
after removing what it wrote (`latest` still names the previous checkpoint).

With LoRA the HF files are the merged model (base + adapter), written only when asked
(`merged=True`: `lora_save_merged`, and the run's final checkpoint); `adapter/` is always
there, loads with `PeftModel.from_pretrained(base, "step_N/adapter")`, and DeepSpeed's state
holds the trainable parameters only (the frozen base is the model folder the run started from).

Saving is collective (ZeRO gathers): every rank calls `save_checkpoint`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.disk import writing
from learner.engine import in_checkpoint_layout, iter_full_params
from learner.lora import is_lora, save_adapter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "vocab.txt", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json",
                   # a vision-language model's processor (its image processor and how it joins the tokenizer)
                   "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_hf(engine, out: Path, tokenizer_src: str | Path) -> None:
    """The policy as an HF folder (collective under ZeRO-3; rank 0 writes). A LoRA policy is
    written merged (base + adapter, under the base model's names)."""
    from safetensors.torch import save_file

    model = engine.module.get_base_model() if is_lora(engine) else engine.module
    named = iter_full_params(engine)
    if hasattr(model.config, "vision_config"):
        # a vision-language model is held under other names than its checkpoint's (`model.visual.`
        # for `visual.`, `model.language_model.` for `model.`): written as save_pretrained writes it
        named = in_checkpoint_layout(engine, named)
    state = dict(named)  # empty except on rank 0; a LoRA model's merged
    if dist.get_rank() != 0:
        return
    out.mkdir(parents=True, exist_ok=True)
    # tied weights are one parameter in named_parameters(): the file holds it once, as HF does
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config
    config.dtype = next(iter(state.values())).dtype if state else torch.float32
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    src = Path(tokenizer_src)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


def save_checkpoint(run_dir: str | Path, step: int, policy, critic=None, tokenizer_src: str | Path = "",
                    extra: dict[str, Any] | None = None, keep: int = 0, merged: bool = False,
                    also=None) -> Path:
    """Save everything needed to continue at `step`; returns the folder. Called on every rank.

    A LoRA policy saves its adapter, and the merged HF model only with `merged`; any other
    policy always saves its HF model. `also(folder)` (collective) writes more into it before it is
    marked complete (the EMA: a checkpoint resumed from never lacks what it was saved with)."""
    out = checkpoints_dir(run_dir) / f"step_{step}"
    try:
        # (torch.save says only "file write failed": a failure on a nearly full disk counts as a full one)
        with writing(out, nearly_full=True):
            _save(run_dir, out, step, policy, critic, tokenizer_src, extra, keep, merged, also)
    except BaseException:
        latest = checkpoints_dir(run_dir) / "latest"
        if dist.get_rank() == 0 and not (latest.is_file() and latest.read_text().strip() == out.name):
            shutil.rmtree(out, ignore_errors=True)  # (half-written: never resumed from, and its space is back)
            latest.with_name("latest.tmp").unlink(missing_ok=True)
        raise
    dist.barrier()
    return out


def _save(run_dir, out: Path, step: int, policy, critic, tokenizer_src, extra, keep, merged, also) -> None:
    root = out.parent
    if dist.get_rank() == 0:
        if out.exists():  # a half-written one from a killed run
            shutil.rmtree(out)
        out.mkdir(parents=True)
    dist.barrier()
    lora = is_lora(policy)
    if lora:
        save_adapter(policy, out / "adapter")
    if merged or not lora:
        save_hf(policy, out, tokenizer_src)
    # LoRA: the frozen base is not state (it is the model folder the run started from)
    policy.save_checkpoint(str(out / "deepspeed"), tag="state", save_latest=False, exclude_frozen_parameters=lora)
    if critic is not None:
        critic.save_checkpoint(str(out / "critic"), tag="state", save_latest=False)
    if also is not None:
        also(out)
    dist.barrier()
    if dist.get_rank() == 0:
        # `step` is both the next step to train and the next batch to ask the buffer for (its data position)
        state = {"step": step, "version": step, "next_batch_step": step, "world_size": dist.get_world_size(),
                 "saved_at": time.time(), **(extra or {})}
        _write_atomic(out / "trainer_state.json", json.dumps(state, indent=2) + "\n")
        _write_atomic(root / "latest", out.name + "\n")
        if keep:
            for old in list_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints (with trainer_state.json), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if (p / "trainer_state.json").is_file() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder `latest` names, else the newest complete one, else None."""
    root = checkpoints_dir(run_dir)
    marker = root / "latest"
    if marker.is_file():
        p = root / marker.read_text().strip()
        if (p / "trainer_state.json").is_file():
            return p
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def restore_latest(run_dir: str | Path, policy, critic=None, ranks_key: str = "the number of ranks",
                   zero_key: str = "zero_stage") -> tuple[int, Path | None]:
    """(step, folder) of the latest checkpoint under run_dir, loaded into the engines; (0, None) if none.

    ZeRO partitions only load under the number of ranks that saved them: another number fails here,
    naming the keys that fix it (`ranks_key`, `zero_key`), before DeepSpeed fails less clearly."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return 0, None
    saved = json.loads((ckpt / "trainer_state.json").read_text())
    world, zero = dist.get_world_size(), policy.zero_optimization_stage()
    if saved.get("world_size", world) != world and zero > 0:
        raise RuntimeError(f"{ckpt} was saved by {saved['world_size']} rank(s) with ZeRO-{zero} partitions and "
                           f"this run has {world}; resume it with {ranks_key}={saved['world_size']} (only "
                           f"{zero_key}=0 checkpoints load under another number of ranks)")
    return int(load_checkpoint(ckpt, policy, critic)["step"]), ckpt


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """A step folder's trainer_state.json: the step, and what the loop added (e.g. the KL coefficient)."""
    return json.loads((Path(path) / "trainer_state.json").read_text())


def load_checkpoint(path: str | Path, policy, critic=None) -> dict[str, Any]:
    """Restore the engines (weights, optimizer, LR schedule) from `path`; returns trainer_state.json."""
    path = Path(path)
    state = read_trainer_state(path)
    lora, has_adapter = is_lora(policy), (path / "adapter").is_dir()
    if lora != has_adapter:  # the module's names differ: a non-strict load would load nothing
        raise RuntimeError(f"{path} was saved {'with' if has_adapter else 'without'} LoRA and this run trains "
                           f"{'LoRA adapters' if lora else 'the full weights'}: "
                           "resume with the lora_rank it was saved with")
    load_path, _ = policy.load_checkpoint(str(path / "deepspeed"), tag="state", load_module_strict=not is_lora(policy),
                                          load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no policy state under {path / 'deepspeed'}")
    if critic is not None:
        load_path, _ = critic.load_checkpoint(str(path / "critic"), tag="state",
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no critic state under {path / 'critic'}")
    return state
