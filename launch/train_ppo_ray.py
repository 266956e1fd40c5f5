"""OpenRLHF's PPO entry point, run by Conveyor: `python -m launch.train_ppo_ray <OpenRLHF flags>`.

A drop-in for `python3 -m openrlhf.cli.train_ppo_ray`: the same command line (0.11.2's dotted
flags or 0.11's underscore ones, read by the table in launch/openrlhf/flags.py) starts the same roles
with `launch.ray` (a local Ray cluster, or the one of RAY_ADDRESS, which `ray job submit` sets):

    ray job submit --address http://HEAD:8265 -- python3 -m launch.train_ppo_ray \\
        --ref_num_nodes 1 --ref_num_gpus_per_node 1 --actor_num_gpus_per_node 1 --vllm_num_engines 1 \\
        --pretrain MODEL --reward_pretrain RM --prompt_data DATA ...

What `launch.local` and `launch.ray` leave at Conveyor's defaults this entry point sets to
OpenRLHF's, where the meaning differs (`OPENRLHF_DEFAULTS`): synchronous training, PPO with GAE
and a critic (from the reward model), the KL (k1, 0.01) folded into the reward, no
behaviour-policy correction, one sample per prompt, OpenRLHF's batch sizes, AdamW (0.9, 0.95)
with a cosine schedule and 3% warm-up, bf16, `input` prompts without the chat template. Every
flag given on the command line wins over these. Placement not given is one process per role
(OpenRLHF would ask for 8 GPUs each): pass the `--*_num_gpus_per_node` flags as there. Conveyor's own keys (`--ray.*`,
`--learner.*`, ...) and a YAML file (`--config FILE`) work too. OpenRLHF's colocation flags set
`run.placement` (`--colocate_all_models`: colocate); `--plan` prints the device plan and exits
(`CONVEYOR_FAKE_GPUS=8`: as on one node of 8 GPUs), as `launch.ray --plan` does.
"""

from __future__ import annotations

import sys

OPENRLHF_DEFAULTS = [
    "--train.async_enable=false", "--algo.advantage.estimator=gae", "--algo.kl.init_coef=0.01",
    "--algo.kl.use_loss=false", "--algo.kl.estimator=k1", "--algo.advantage.is_correction_level=off",
    "--rollout.n_samples_per_prompt=1", "--rollout.batch_size=1024", "--train.batch_size=128",
    "--train.micro_batch_size=1", "--actor.adam.betas=0.9,0.95", "--critic.adam.lr=9e-6",
    "--critic.value_clip=0.5", "--actor.lr_scheduler=cosine_with_min_lr", "--actor.min_lr_ratio=0.1",
    "--actor.lr_warmup_ratio=0.03", "--ds.param_dtype=bf16", "--data.input_key=input",
    "--data.apply_chat_template=false", "--reward.clip_range=-10,10",
]
"""OpenRLHF 0.11.2's defaults that differ in meaning from Conveyor's, as flags put before the user's."""


def with_defaults(argv: list[str]) -> list[str]:
    """OpenRLHF's defaults, then `argv` (a later flag wins); a critic from the reward model as there,
    when PPO with GAE trains one and none is named."""
    from common.config import parse_overrides
    from launch.openrlhf.flags import LEGACY

    flags = {LEGACY.get(k, k): v for k, v in parse_overrides(argv).items()}
    extra = []
    estimator = flags.get("algo.advantage.estimator", "gae")
    if estimator == "gae" and "critic.model_name_or_path" not in flags and "learner.critic_path" not in flags:
        reward = flags.get("reward.model_name_or_path", "")
        if reward:
            extra.append(f"--learner.critic_path={reward.split(',')[0]}")
    return [*OPENRLHF_DEFAULTS, *extra, *argv]


def main(argv: list[str] | None = None) -> None:
    from common.config import wants_help
    from launch import ray

    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv) or not argv:
        from launch.cluster.config import ray_help

        print((__doc__.strip() + "\n\n" + ray_help(ray.__doc__)).rstrip())
        sys.exit(0 if argv else 2)
    config = []
    if "--config" in argv:  # launch.ray's CONFIG, given as a flag (OpenRLHF's command line has none)
        i = argv.index("--config")
        config, argv = argv[i + 1:i + 2], argv[:i] + argv[i + 2:]
    from common.config import ConfigError

    try:
        argv = with_defaults([a for a in argv if not a.startswith("--local_rank")])
    except ConfigError as e:
        print(f"launch.train_ppo_ray: {e}", file=sys.stderr)
        sys.exit(2)
    ray.main([*config, *argv])


if __name__ == "__main__":
    main()
