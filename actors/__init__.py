"""The actors: the roles that produce training data, the generators and the scorers.

Reading order: `generator.py` (the generator's loop, `run`: lease prompt groups from the buffer,
sample completions, push rollouts; weights arrive between batches through `weight_hook.py`),
`prompts.py` (how a prompt becomes token ids), `scorer.py` (the scorer's loop, `run`: pull raw
rollouts from the buffer's relay, score them with `rewards.py`, push them back scored), `config.py`
(sections `generator:` and `scorer:`). Beside the scorer: `reward_files.py` (a reward function file,
Conveyor's `reward_fn` or OpenRLHF's `reward_func`, run in a worker process of its own), `answers.py`
(the math answer helpers OpenRLHF's reward files import from `openrlhf.utils`), `reward_server.py`
(a reward model behind HTTP, `python -m launch.serve_rm`). Then the subpackages: `engines/` (what
samples: vLLM or a plain transformers model), `envs/` (multi-turn episodes), `tools/` (tools a policy
can call), `agents/` (agent code behind an OpenAI-compatible endpoint).

Imports `buffer`, `weight_sync`, `common`, and from `learner` only `learner.modeling`.
"""
