"""Tools a policy can call during an episode.

Reading order: `registry.py` (the tools, the registry that runs them with limits, and the text
formats a call is written in), `sandbox.py` (the limited subprocess behind the `python` tool).
The environment that offers tools to a policy is `actors/envs/tool_env.py`.
"""
