"""OpenRLHF's command line, run by Conveyor (`python -m launch.train_ppo_ray <OpenRLHF flags>`).

Reading order: `flags.py` (every flag of OpenRLHF's `train_ppo_ray`: mapped, accepted or refused),
`resolve.py` (flags whose meaning needs the others, and the refusals).
"""
