"""What the recipes buy, measured in one run: LoRA's weight rounds and packed learner batches.

    .venv/bin/python bench/recipes.py            # ~2 minutes on 2 cores
    .venv/bin/python bench/recipes.py --quick    # the tiny model for both (~1 minute)

Two figures, each a ratio of two things measured side by side in this run:
- `lora_bytes_ratio`: bytes one weight round moves with a LoRA policy (rank 8, all-linear) over
  full fine-tuning of the same model (4 layers, hidden 512), through the real weight-sync service
  (`bench/lora_sync.py`). Goal: the ratio of trainable parameters (`lora_trainable_ratio`).
- `packing_ratio`: learner tokens/s of the learner's own `train_step`, packed over padded, on 64
  rollouts whose lengths spread 10x (16..160 tokens), with the 4-layer, hidden-256 model, the
  whole step one micro-batch as by the learner's default (`bench/packing.py --model small
  --grad-accum 1`; more micro-batches pack fewer sequences per row: `--grad-accum 4` gains less).
  Goal: >= 1.5x.

Dynamic sampling is measured on the demo task by `bench/dynamic_sampling.py` (two whole runs,
several minutes). Progress goes to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny model (2 layers, hidden 128) for both figures")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per learner step (the learner's default: 1)")
    p.add_argument("--repeat", type=int, default=3, help="timed learner steps per layout (the fastest counts)")
    a = p.parse_args(argv)

    import lora_sync
    import packing

    lora = lora_sync.measure(*((2, 128) if a.quick else (4, 512)))
    print(f"lora: {lora['lora']['wire_bytes']:,} of {lora['full']['wire_bytes']:,} bytes per round "
          f"({lora['bytes_ratio']:.4f}; trainable params {lora['trainable_ratio']:.4f})", file=sys.stderr)
    pack = packing.measure("tiny" if a.quick else "small", grad_accum=a.grad_accum, repeat=a.repeat)
    print(f"packing: {pack['learner']['padded']['tokens_per_s']:.0f} -> "
          f"{pack['learner']['packed']['tokens_per_s']:.0f} "
          f"tokens/s ({pack['ratio']}x)", file=sys.stderr)
    print(json.dumps({
        "bench": "recipes", "quick": a.quick,
        "lora_bytes_full": lora["full"]["wire_bytes"], "lora_bytes_lora": lora["lora"]["wire_bytes"],
        "lora_bytes_ratio": round(lora["bytes_ratio"], 5), "lora_trainable_ratio": round(lora["trainable_ratio"], 5),
        "packing_model": pack["model"], "packing_grad_accum": a.grad_accum,
        "packing_padded_tokens_per_s": pack["learner"]["padded"]["tokens_per_s"],
        "packing_packed_tokens_per_s": pack["learner"]["packed"]["tokens_per_s"], "packing_ratio": pack["ratio"],
        "packing_reference_ratio": pack["reference_ratio"],
    }))


if __name__ == "__main__":
    main()
