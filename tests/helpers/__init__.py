"""What many tests share, one module per idea: `procs` (role processes, the project's root), `buffer`
(a buffer process or its bookkeeping, scored rollouts), `learner` (rollout groups and a buffer
stand-in), `fuzz` (the corpus of broken messages), `cluster` (Ray launcher and OpenRLHF runs), and the
scripts tests run as processes of their own: `ws_generator.py`, `lora_sync_driver.py`.
A test module imports from here, never from another test module.
"""
