"""Modules that moved, under their old dotted names, so that a name an earlier run stored keeps loading.

A resolved config (`<run_dir>/resolved.yaml`) names code by dotted path: the vLLM worker extension
(`generator.worker_extension`), environments and reward functions (`package.module:name`). The tree was
regrouped into subpackages; `current_name` maps a name under an old module to the module's new place,
and `import_module` imports by either name.
"""

from __future__ import annotations

import importlib
import types

MOVED = {  # old module -> new module (`actors.engines`, `actors.tools`, `launch.openrlhf` and
    # `learner.offline` became packages of their own name, which keep their package names)
    "actors.transformers_engine": "actors.engines.hf",
    "actors.vllm_engine": "actors.engines.vllm.engine",
    "actors.vllm_worker": "actors.engines.vllm.worker",
    "actors.vllm_load": "actors.engines.vllm.load",
    "actors.env": "actors.envs.api",
    "actors.episodes": "actors.envs.episodes",
    "actors.tool_env": "actors.envs.tool_env",
    "actors.env_libs": "actors.envs.arena",
    "actors.openrlhf_agent": "actors.envs.openrlhf_agent",
    "actors.sandbox": "actors.tools.sandbox",
    "actors.agent_sessions": "actors.agents.sessions",
    "actors.openai_server": "actors.agents.openai_server",
    "learner.offline_config": "learner.offline.config",
    "learner.datasets": "learner.offline.datasets",
    "learner.sft": "learner.offline.sft",
    "learner.dpo": "learner.offline.dpo",
    "learner.rm": "learner.offline.rm",
    "buffer.protocol": "buffer.messages",
    "launch.ray_config": "launch.cluster.config",
    "launch.ray_devices": "launch.cluster.devices",
    "launch.ray_placement": "launch.cluster.placement",
    "launch.ray_roles": "launch.cluster.roles",
    "launch.ray_run": "launch.cluster.run",
    "launch.ray_scale": "launch.cluster.scale",
    "launch.ray_status": "launch.cluster.status",
    "launch.openrlhf_resolve": "launch.openrlhf.resolve",
}


def current_name(dotted: str) -> str:
    """`dotted` (`module`, `module.Attr` or `module:attr`) with an old module name replaced by its new one."""
    head, sep, tail = dotted.partition(":")
    parts = head.split(".")
    for n in range(len(parts), 0, -1):
        new = MOVED.get(".".join(parts[:n]))
        if new is not None:
            return ".".join([new, *parts[n:]]) + sep + tail
    return dotted


def import_module(name: str) -> types.ModuleType:
    """`importlib.import_module`, taking a moved module's old name as well."""
    return importlib.import_module(current_name(name))
