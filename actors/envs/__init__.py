"""Environments for multi-turn episodes: the policy writes, an environment answers, until done.

Reading order: `api.py` (what an environment is: `Row`, `StepResult`, `reset`/`step`, and the
guarded calls that keep a faulty environment from taking the generator down), `episodes.py` (how the
generator plays a prompt group's episodes and turns them into rollouts), `loader.py` (how a config
names an environment), then the adapters: `tool_env.py` (tasks answered with tools, see
`actors/tools/`), `arena.py` (TextArena's games), `openrlhf_agent.py` (OpenRLHF agent files),
`agent_executor.py` (OpenRLHF agent files whose `AgentExecutor` runs its own `execute`).
"""
