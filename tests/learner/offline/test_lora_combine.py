"""`python -m launch.lora_combiner`: a LoRA adapter merged into its base gives the base+adapter model's
logits, for a policy (causal LM) and for a reward model (one-label sequence classifier)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers.procs import ROOT, subprocess_env

IDS = torch.tensor([[1, 5, 9, 12, 7, 3, 20, 33], [1, 40, 41, 42, 43, 44, 45, 46]])


def randomise_adapter(model) -> None:
    """Give every LoRA B (zero when peft creates it) and a trained head random values, so merging matters."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def test_policy_adapter_merges_to_the_same_logits(tmp_path, tiny_model_dir):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    randomise_adapter(model)
    model.save_pretrained(tmp_path / "adapter")
    out = subprocess.run([sys.executable, "-m", "launch.lora_combiner", "--model_path", str(tiny_model_dir),
                          "--lora_path", str(tmp_path / "adapter"), "--output_path", str(tmp_path / "merged"),
                          "--dtype", "float32"], capture_output=True, text=True, cwd=ROOT, env=subprocess_env(),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                      str(tmp_path / "adapter")).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want, got, before = tuned(IDS).logits, merged(IDS).logits, plain(IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (want - before).abs().max() > 1e-2  # the adapter changed the model: the check is not vacuous
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    assert not any(k for k in merged.state_dict() if "lora" in k)


def test_reward_model_adapter_merges_with_its_trained_head(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from launch.lora_combiner import main
    from learner.lora import apply_lora
    from learner.offline.config import RMConfig
    from learner.offline.rm import load_reward_model

    # as launch.rm --ds.lora.rank 4 trains it: adapters on every linear layer, the new score head in full
    model = apply_lora(load_reward_model(str(tiny_model_dir), pad_token_id=0),
                       RMConfig(lora_rank=4, lora_alpha=8))
    randomise_adapter(model)
    model.save_pretrained(tmp_path / "adapter")
    argv = ["--model_path", str(tiny_model_dir), "--lora_path", str(tmp_path / "adapter"),
            "--output_path", str(tmp_path / "merged"), "--is_rm", "--ds.param_dtype", "fp32"]
    assert main(argv) == 0
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert merged.config.num_labels == 1 and merged.config.pad_token_id == 0
    tuned = PeftModel.from_pretrained(load_reward_model(str(tiny_model_dir), pad_token_id=0),
                                      str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want, got = tuned(IDS).logits, merged(IDS).logits  # (2, 1) each, at the last token
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert got.shape == (2, 1)


def test_lora_combiner_flags_of_openrlhf_parse_and_missing_paths_are_named():
    from common.config import ConfigError
    from launch.entry import role_config
    from launch.lora_combiner import LORA_COMBINER_ALIASES
    from learner.offline.config import LoraCombineConfig

    base = ["--model_path", "/b", "--lora_path", "/a", "--output_path", "/o"]
    cfg = role_config(LoraCombineConfig, "lora_combiner", base, LORA_COMBINER_ALIASES)
    assert (cfg.model_path, cfg.lora_path, cfg.output_path, cfg.is_rm, cfg.dtype) == ("/b", "/a", "/o", False,
                                                                                       "bfloat16")
    for flags, dtype in ((["--ds.param_dtype", "fp16"], "float16"), (["--bf16"], "bfloat16"),
                         (["--param_dtype", "bf16"], "bfloat16")):
        assert role_config(LoraCombineConfig, "lora_combiner", base + flags + ["--is_rm"],
                           LORA_COMBINER_ALIASES).dtype == dtype
    with pytest.raises(ConfigError, match="lora_combiner.lora_path is empty"):
        role_config(LoraCombineConfig, "lora_combiner", base[:2] + base[4:], LORA_COMBINER_ALIASES)
    with pytest.raises(ConfigError, match="--ds.param_dtype: cannot use 'int8'"):
        role_config(LoraCombineConfig, "lora_combiner", base + ["--ds.param_dtype", "int8"], LORA_COMBINER_ALIASES)
