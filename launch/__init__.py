"""How a run starts: one entry point per role, the run's configuration, and the two launchers.

Reading order: an entry point (`python -m launch.buffer`, `launch.weight_sync`, `launch.generator`,
`launch.scorer`, `launch.learner`, and the offline `launch.sft`, `launch.dpo`, `launch.rm`), all a
few lines around `entry.py`; `run_config.py` (one YAML file for the whole run); the local launcher
(`local.py`, with `roles.py`, `supervisor.py`, `process.py`, `recovery.py`); the device plan
(`devices`); the Ray launcher (`ray.py`, with `cluster/`); OpenRLHF's command line
(`train_ppo_ray.py`, with `openrlhf/`); `serve_rm.py` (a reward model over HTTP) and `lora_combiner.py` (an
adapter merged into its base); the tools `keys.py`, `ledger.py`, `ports.py`, and `demo.py`.

Imports everything; nothing of the project imports it.
"""
