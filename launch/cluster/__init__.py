"""The Ray launcher's machinery (`python -m launch.ray`; named `cluster` so it never shadows `ray`).

Reading order: `config.py` (section `ray:`), `placement.py` (a placement group per role),
`devices.py` (the device plan on Ray's bundles), `roles.py` (the Ray actors: one per role process,
and the run's controller), `run.py` (one attempt: start, supervise, stop), `scale.py` (generators
joining and leaving), `status.py` (how the run stands).
"""
