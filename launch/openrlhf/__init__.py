"""OpenRLHF's command lines, run by Conveyor (`python -m launch.train_ppo_ray <OpenRLHF flags>`, and
`launch.sft`, `launch.dpo`, `launch.rm` with OpenRLHF's offline flags).

Reading order: `flags.py` (every flag of OpenRLHF's `train_ppo_ray`: mapped, accepted or refused),
`resolve.py` (flags whose meaning needs the others, and the refusals), `offline.py` (every flag of
`train_sft`, `train_dpo` and `train_rm`, the same three kinds).
"""
