"""LoRA RL: only adapters train, the reference is the frozen base, checkpoints hold the adapter in
peft's format and resume, and an adapter-only weight round makes vLLM serve exactly the merged model.

The learner runs in this process (a world of one, as `test_learner_step.py` does); the weight
round into vLLM runs in `tests/helpers/lora_sync_driver.py` (vLLM spawns its engine: a script of its own).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from learner.config import LearnerConfig
from tests.helpers.learner import ListSource, make_group
from tests.helpers.procs import ROOT, subprocess_env


def lora_config(model_dir, run_dir, **kw) -> LearnerConfig:
    fields = dict(model_path=str(model_dir), run_dir=str(run_dir), lora_rank=8, lora_alpha=16, lr=5e-3,
                  dist_backend="gloo", tensorboard=False)
    return LearnerConfig(**{**fields, **kw})


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_reference_is_the_base_and_the_merged_weights_are_the_policy(tiny_model_dir, tmp_path, zero_stage):
    from transformers import AutoModelForCausalLM

    from learner.engine import build_policy_engine, iter_full_params, iter_publish_params, process_group
    from learner.lora import adapter_spec, reference_logprobs
    from learner.modeling import token_logprobs

    cfg = lora_config(tiny_model_dir, tmp_path, zero_stage=zero_stage, lr=2e-2)
    ids = torch.randint(3, 30, (2, 12), generator=torch.Generator().manual_seed(0))  # (B, L)
    attn = torch.ones_like(ids)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        base_lp = token_logprobs(base, ids, attn)  # (B, L-1)
    with process_group(cfg):
        policy = build_policy_engine(cfg)
        for _ in range(2):
            policy.backward(-token_logprobs(policy, ids, attn).mean())
            policy.step()
        ref_lp = reference_logprobs(policy, ids, attn)
        with torch.no_grad():
            policy_lp = token_logprobs(policy, ids, attn)
        merged = dict(iter_full_params(policy))
        sent = dict(iter_publish_params(policy))
        spec = adapter_spec(policy)
    assert torch.equal(ref_lp, base_lp)  # the adapter off is the base, bit for bit
    assert (policy_lp - base_lp).abs().max() > 0.1  # ... and the adapter did learn
    # the merged weights, under the base names, give the policy's log-probs
    base.load_state_dict(merged, strict=True)
    with torch.no_grad():
        assert torch.allclose(token_logprobs(base, ids, attn), policy_lp, atol=1e-5)
    # a round sends the adapter only: A and B of the 14 linear layers of 2 blocks (all-linear: no head)
    assert len(sent) == 28 and all(".lora_A." in n or ".lora_B." in n for n in sent)
    assert spec["r"] == 8 and spec["lora_alpha"] == 16 and len(spec["target_modules"]) == 14
    assert "lm_head" not in " ".join(spec["target_modules"])


def test_lora_run_saves_peft_adapters_and_resumes_as_an_uninterrupted_run(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from learner.trainer import train

    steps = {s: make_group(2 * s, 4, [1.0, 0.0, 0.5, 0.2], seed=s)
                + make_group(2 * s + 1, 4, [0.0, 1.0, 1.0, 0.3], seed=s)
             for s in range(3)}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(lora_config(tiny_model_dir, whole, total_steps=3, zero_stage=2), source=ListSource(steps))
    train(lora_config(tiny_model_dir, cut, total_steps=2, save_every=1, zero_stage=2), source=ListSource(steps))
    train(lora_config(tiny_model_dir, cut, total_steps=3, save_every=1, zero_stage=2, resume=True),
        source=ListSource(steps))

    ckpt = cut / "checkpoints" / "step_3"
    adapter = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    expected = load_file(str(whole / "checkpoints" / "step_3" / "adapter" / "adapter_model.safetensors"))
    assert adapter.keys() == expected.keys() and len(adapter) == 28
    for k in adapter:  # the resumed run restored the adapter, AdamW's moments and the schedule
        assert torch.allclose(adapter[k], expected[k], atol=1e-6), k
    assert not (ckpt / "config.json").exists()  # no merged model unless asked for
    # DeepSpeed's state holds the adapter only: far smaller than the model
    state = sum(p.stat().st_size for p in (ckpt / "deepspeed").rglob("*") if p.is_file())
    assert state < (tiny_model_dir / "model.safetensors").stat().st_size
    # peft loads the adapter onto the base, and it is not the base any more
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, str(ckpt / "adapter"))
    assert any(torch.count_nonzero(p) for n, p in tuned.named_parameters() if "lora_B" in n)


@pytest.mark.slow
def test_adapter_rounds_make_vllm_serve_the_merged_checkpoint(tiny_model_dir, tmp_path):
    """Two versions, each a real adapter-only round into a LoRA vLLM engine and a transformers
    engine (which merges by hand): both give the greedy outputs of transformers on the merged
    checkpoint of that version, and record the version they hold."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "lora_sync_driver.py"), str(tiny_model_dir),
                           str(tmp_path / "run")], env=subprocess_env(), capture_output=True, text=True, timeout=400)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and len(lines) == 3, proc.stderr[-3000:]
    base_out = lines[0]["vllm"]
    for version, line in enumerate(lines[1:], start=1):
        assert line["ok"] == ["merging", "vllm"] and line["versions"] == {"vllm": version, "merging": version}
        assert line["vllm"] == line["merged_checkpoint"] == line["merging"], line
        # the adapter alone: per block, q k v o (8x128 + 128x8 each) + gate up (8x128 + 256x8) + down
        # (8x256 + 128x8) = 17,408 parameters; 2 blocks, fp32
        assert line["bytes"] == 2 * 17_408 * 4
    assert lines[1]["vllm"] != base_out  # the adapter changed what is served


def test_lora_kl_reference_comes_from_the_base_inside_the_learner(tiny_model_dir, tmp_path):
    """With kl_coef > 0 and rollouts that carry no reference log-probs, a LoRA learner takes them from
    its own base (adapter off): the KL is 0 while the adapter is still zero, and grows as it trains."""
    from learner.trainer import train

    steps = {s: make_group(2 * s, 4, [1.0, 0.0, 0.5, 0.2], seed=s)
                + make_group(2 * s + 1, 4, [0.0, 1.0, 1.0, 0.3], seed=s)
             for s in range(3)}
    run_dir = tmp_path / "kl"
    train(lora_config(tiny_model_dir, run_dir, total_steps=3, zero_stage=2, kl_coef=0.1, packing=True),
        source=ListSource(steps))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [r["policy/kl_to_ref"] for r in rows]
    assert len(rows) == 3 and kl[0] == 0.0 and kl[-1] > 0, kl  # B starts at 0: the policy is the base
    assert all(r["loss/kl"] >= 0 for r in rows)
    assert (run_dir / "checkpoints" / "step_3" / "config.json").is_file()  # the final one holds the merged model
