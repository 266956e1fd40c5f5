"""The learner: DeepSpeed ranks that train the policy off-policy from the buffer's batches.

Reading order: `trainer.py` (one rank's loop, `run` -> `train`, read top to bottom: a batch from
`source.py`, tensors from `batching.py` and `packing.py`, advantages from `advantages.py`, the
losses of `losses.py`, a DeepSpeed step set up by `engine.py`, a weight publish through
`weight_sync`, a checkpoint by `checkpoint.py`, the ledger's row by `ledger.py`, metrics by
`metrics.py`); `config.py` (section `learner:`); `lora.py` (adapters); `modeling.py` (loading and
token log-probs, light: no DeepSpeed import, so scorers and generators use it too). The knobs the
loop uses: `token_budget.py` (micro-batches cut by a token budget), `kl_control.py` (the KL
coefficient of each step, fixed or adaptive), `ema.py` (an exponential moving average of the
policy), `moe.py` (a mixture-of-experts policy's router load-balancing loss). Then
`offline/`: the SFT, DPO and reward-model trainers, which share `engine.py` and `metrics.py`.

Imports `buffer`, `weight_sync` and `common`.
"""
