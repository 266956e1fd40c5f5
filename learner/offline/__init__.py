"""The offline trainers: supervised fine-tuning, DPO and reward models, without the buffer.

Reading order: `config.py` (sections `sft:`, `dpo:`, `rm:`, `lora_combiner:`), `datasets.py` (rows
to tokenized sequences), `loop.py` (the loop the three share: data in, DeepSpeed steps, metrics,
saves), then one trainer: `sft.py`, `dpo.py`, `rm.py`. The DeepSpeed setup is the RL learner's
(`learner/engine.py`). Last, `lora_combine.py` (a trained LoRA adapter merged into its base:
`python -m launch.lora_combiner`).
"""
