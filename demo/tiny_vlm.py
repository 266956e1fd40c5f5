"""A tiny vision-language model (the Qwen2-VL architecture) and its processor, written to a folder on the fly.

Nothing can be downloaded at run time, so tests and the vision demo build their model here. The
folder loads like a hub checkpoint of Qwen2-VL: `AutoModelForImageTextToText` /
`Qwen2VLForConditionalGeneration`, `AutoProcessor` (the image processor, the tokenizer, the chat
template) and vLLM (`Qwen2VLForConditionalGeneration`, its CPU build included).

- The language model is demo.tiny_model's shape (2 layers, hidden 128, head_dim 64: vLLM's CPU
  attention) with M-RoPE (`mrope_section` [8, 12, 12]: half of head_dim, split over time, height
  and width as Qwen2-VL splits its 128).
- The vision tower is one block (`vision_depth`), 64 wide, 14-pixel patches merged 2x2: a 56x56
  image is 4x4 patches, and 4 placeholder tokens (`<|image_pad|>`) in the prompt, one per 28x28
  square of it.
- The tokenizer is demo.tiny_model's character tokenizer plus Qwen2-VL's vision tokens
  (`<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`).
- The chat template writes "role: content" lines, an image part as
  `<|vision_start|><|image_pad|><|vision_end|>` (the processor expands the pad to the image's
  tokens), and ends a generation prompt with "assistant: ".
- The image processor takes 56x56 up to 112x112 pixels (`min_pixels`, `max_pixels`): a larger image
  is scaled down, so a prompt's image tokens stay few.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}" + IMAGE_PART +
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
PATCH, MERGE = 14, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def build_tokenizer():
    """demo.tiny_model's character tokenizer with the vision tokens and the chat template."""
    from demo.tiny_model import build_tokenizer as text_tokenizer

    tok = text_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_vlm(path: str | os.PathLike, *, num_layers: int = 2, hidden_size: int = 128, vision_depth: int = 1,
                   vision_width: int = 64, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a seeded random tiny Qwen2-VL with its processor to `path`; return the folder.

    The same arguments give the same weights, so two processes that each call this agree."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    from demo.tiny_model import BOS, EOS, HEAD_DIM, PAD

    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of {HEAD_DIM} (head_dim {HEAD_DIM})")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    heads = hidden_size // HEAD_DIM
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
            pad_token_id=tok.convert_tokens_to_ids(PAD), bos_token_id=tok.convert_tokens_to_ids(BOS),
            eos_token_id=tok.convert_tokens_to_ids(EOS)),
        vision_config=dict(depth=vision_depth, embed_dim=vision_width, hidden_size=hidden_size,
                           num_heads=max(1, vision_width // 64), mlp_ratio=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model = model.to(getattr(torch, dtype))
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    images = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH, merge_size=MERGE)
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                                 chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    tok.save_pretrained(path)
    meta = {"builder": "conveyor.demo.tiny_vlm", "family": "qwen2_vl", "seed": seed, "num_layers": num_layers,
            "hidden_size": hidden_size, "vision_depth": vision_depth}
    (path / "conveyor_tiny.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Write the tiny Qwen2-VL, its processor and tokenizer to a folder.")
    p.add_argument("path")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--vision-depth", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(build_tiny_vlm(a.path, num_layers=a.num_layers, hidden_size=a.hidden_size, vision_depth=a.vision_depth,
                         seed=a.seed))


if __name__ == "__main__":
    main()
