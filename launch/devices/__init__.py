"""The device plan: which GPUs each role process gets, what share of their memory, and whether it fits.

Decided once per run, before any role starts, by both launchers (`launch.local`, `launch.ray`),
and printed by `--plan`. Everything here is plain arithmetic on the run config and the list of
GPUs (no CUDA call), so every layout is tested on a CPU machine. One plan, in the order a reader
meets it:

1. `gpus.local_gpus` finds this machine's GPUs (run.gpus, $CONVEYOR_FAKE_GPUS or nvidia-smi,
   within the launcher's own CUDA_VISIBLE_DEVICES) as `gpus.Node`s of `gpus.Gpu`s (`launch.ray`
   makes its nodes from the cluster's instead: `launch.cluster.devices`);
2. `memory.demand_of` reads what the run asks for off its config, a `memory.Demand`: how many
   processes of each role, and what each needs of a device, estimated from its model folder
   (`memory.model_size`, `memory.learner_gb`);
3. `plan.make_plan` lays the demand out on the nodes, a `plan.DevicePlan` of one `plan.Placement`
   per role process (its devices, its share of each, the role it starts after), or refuses with a
   `gpus.PlanError` that has the numbers and the knob to turn; `plan.plan_run` is 1-3 for a run;
4. each role process gets its part as `DevicePlan.env` (CUDA_VISIBLE_DEVICES, its memory cap) and
   `DevicePlan.overrides` (an engine's gpu_memory_utilization);
5. `view.device_plan` is the launchers' way in (a refusal becomes a `ConfigError`), and
   `view.print_plan` is `--plan`.

gpus.py and memory.py import nothing of the project; plan.py imports them; view.py also
`launch.recovery`, and `launch.config` and `launch.roles` when called.
"""
