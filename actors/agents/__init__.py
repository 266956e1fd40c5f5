"""Agents: black-box agent code that plays a lease's samples through an OpenAI-compatible endpoint.

Reading order: `sessions.py` (a session per sample: the agent's requests become the policy's turns,
recorded token by token), `openai_server.py` (the HTTP endpoint the agent's `openai` client talks to).
"""
