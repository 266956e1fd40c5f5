"""The tiny model fixture: seeded, loadable by transformers, and served by vLLM (CPU build)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from demo.tiny_model import CHARACTERS, SPECIAL_TOKENS, build_tiny_model, vocab
from tests.helpers.procs import ROOT, subprocess_env


def test_tokenizer_is_one_token_per_character(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "12+34=64\nabc XYZ"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(vocab()) == len(SPECIAL_TOKENS) + len(CHARACTERS)


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    a = load_file(tiny_model_dir / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "again", seed=0) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "other", seed=1) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_loads_and_generates_in_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64  # vLLM's CPU attention needs head_dim 64
    ids = torch.tensor([tok("1+2=")["input_ids"]])
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    assert 1 <= len(new) <= 6 and max(new) < len(vocab())
    # greedy decoding is the argmax of plain forwards, token by token (the cache changes nothing)
    seq = ids
    with torch.no_grad():
        for t in new:
            assert int(model(seq).logits[0, -1].argmax()) == t
            seq = torch.cat([seq, torch.tensor([[t]])], dim=1)


def test_rejects_head_dim_other_than_64(tmp_path):
    with pytest.raises(ValueError, match="multiple of 64"):
        build_tiny_model(tmp_path / "bad", hidden_size=96)


@pytest.mark.slow
def test_generates_in_vllm_same_as_transformers_greedy(tiny_model_dir, tmp_path):
    """vLLM (CPU build) serves the folder; its greedy tokens equal transformers' greedy tokens."""
    script = tmp_path / "vllm_greedy.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        if __name__ == "__main__":
            from vllm import LLM, SamplingParams
            llm = LLM({str(tiny_model_dir)!r}, dtype="float32", seed=0, enforce_eager=True)
            outs = llm.generate([{{"prompt_token_ids": [1, 5, 14, 6, 18]}}],
                                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            print("RESULT " + json.dumps(list(outs[0].outputs[0].token_ids)))
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env=subprocess_env(), cwd=ROOT)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    vllm_tokens = json.loads(lines[-1][len("RESULT "):])

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[1, 5, 14, 6, 18]])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert vllm_tokens == out[0, 5:].tolist()
