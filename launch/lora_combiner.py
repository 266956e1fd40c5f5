"""Merge a LoRA adapter into its base model: `python -m launch.lora_combiner --model_path BASE
--lora_path ADAPTER --output_path OUT [--is_rm] [--dtype bfloat16]`.

OpenRLHF's `lora_combiner` command line as it is: `--model_path`, `--lora_path`, `--output_path`,
`--is_rm` (a reward model: one-label sequence classifier), `--ds.param_dtype bf16|fp16` (also
`--param_dtype`, and `--bf16` of older releases). The merged model is a plain Hugging Face folder
with the base's tokenizer; see learner/offline/lora_combine.py.
"""

from __future__ import annotations

import sys

from common.config import Alias
from launch.entry import role_main
from launch.openrlhf.flags import bf16, choose

param_dtype = choose({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}, "one of bf16, fp16, fp32")
LORA_COMBINER_ALIASES = {
    "ds.param_dtype": Alias(("dtype",), param_dtype),
    "param_dtype": Alias(("dtype",), param_dtype),
    "bf16": Alias(("dtype",), bf16),
}


def main(argv: list[str] | None = None) -> int:
    from learner.offline.config import LoraCombineConfig

    return role_main("lora_combiner", LoraCombineConfig, "learner.offline.lora_combine:run", __doc__, argv,
                     aliases=LORA_COMBINER_ALIASES)


if __name__ == "__main__":
    sys.exit(main())
