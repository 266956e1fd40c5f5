"""A tiny Llama (or a tiny Qwen3-MoE or Mixtral) and a character-level tokenizer, written to a folder on the fly.

Nothing can be downloaded at run time, so tests, benchmarks and the demo build their model here.
The folder loads like any hub model: `AutoModelForCausalLM`, `AutoTokenizer` and vLLM.
`family="qwen3_moe"` builds a mixture of experts (Qwen3-MoE: `num_experts` experts per layer, the
top `experts_per_token` of them per token, no shared expert), the class Qwen3-30B-A3B belongs to;
`family="mixtral"` the same shape as a Mixtral.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
# Everything a prompt of the synthetic tasks (and a little prose) is made of; one token per character.
CHARACTERS = list(string.digits + "+-*/=()<>.,:;?!'\"_#%&" + string.ascii_lowercase + string.ascii_uppercase + " \n")
# vLLM's CPU attention accepts head_dim 64 (not 16), so heads = hidden / 64.
HEAD_DIM = 64
FAMILIES = ("llama", "qwen3_moe", "mixtral")


def vocab() -> dict[str, int]:
    """Token -> id; specials first so pad/bos/eos are 0/1/2 whatever the character set."""
    tokens = SPECIAL_TOKENS + CHARACTERS
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer():
    """A `PreTrainedTokenizerFast` that maps every character to one token and decodes by joining."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token=UNK))
    # [\s\S] rather than "." so that "\n" is a character like any other.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # Every sequence starts with <s> (as Llama tokenizers do), so a prompt encoded by any role,
    # the generator's `encode` or a trainer's `__call__`, yields the same ids.
    v = vocab()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, v[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def build_tiny_model(
    path: str | os.PathLike,
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    family: str = "llama",
    num_experts: int = 8,
    experts_per_token: int = 2,
    moe_intermediate_size: int | None = None,
) -> Path:
    """Write a seeded random Llama (or Qwen3-MoE, or Mixtral) and its tokenizer to `path`; return the folder.

    The same arguments give the same weights (byte for byte), so two processes that each call this
    agree without talking. `hidden_size` must be a multiple of 64 (vLLM's CPU attention).
    A Qwen3-MoE's experts are `moe_intermediate_size` wide (default hidden / 2): its active MLP per
    token is `experts_per_token` of them, as wide as a Llama built with intermediate_size =
    experts_per_token * moe_intermediate_size (the dense model of the same active size).
    """
    import torch

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: one of {FAMILIES}")
    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of {HEAD_DIM} (head_dim {HEAD_DIM})")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    v = vocab()
    # Exactly the tokenizer's size: an id the tokenizer cannot decode would break detokenisation.
    vocab_size = len(v)
    heads = hidden_size // HEAD_DIM
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig as Config
        from transformers import Qwen3MoeForCausalLM as Model

        extra = dict(num_experts=num_experts, num_experts_per_tok=experts_per_token, norm_topk_prob=True,
                     moe_intermediate_size=moe_intermediate_size or hidden_size // 2, decoder_sparse_step=1,
                     mlp_only_layers=[], router_aux_loss_coef=0.0)
    elif family == "mixtral":  # (its experts' width is intermediate_size)
        from transformers import MixtralConfig as Config
        from transformers import MixtralForCausalLM as Model

        intermediate_size = moe_intermediate_size or hidden_size // 2
        extra = dict(num_local_experts=num_experts, num_experts_per_tok=experts_per_token, router_aux_loss_coef=0.0)
    else:
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model

        extra = {}
    config = Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=v[PAD],
        bos_token_id=v[BOS],
        eos_token_id=v[EOS],
        torch_dtype=dtype,
        **extra,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Model(config)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # generation_config.json from save_pretrained carries the special ids; vLLM reads it for defaults.
    meta = {"builder": "conveyor.demo.tiny_model", "family": family, "seed": seed, "num_layers": num_layers,
            "hidden_size": hidden_size}
    (path / "conveyor_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write the tiny Llama (or MoE) and character tokenizer to a folder.")
    p.add_argument("path")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--num-experts", type=int, default=8, help="qwen3_moe, mixtral: experts per layer")
    p.add_argument("--experts-per-token", type=int, default=2,
                   help="qwen3_moe, mixtral: experts each token is routed to")
    a = p.parse_args(argv)
    print(build_tiny_model(a.path, num_layers=a.num_layers, hidden_size=a.hidden_size, seed=a.seed, family=a.family,
                           num_experts=a.num_experts, experts_per_token=a.experts_per_token))


if __name__ == "__main__":
    main()
