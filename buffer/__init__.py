"""The replay buffer: the one service every producer and learner talks to.

Reading order: `messages.py` (every message to or from the buffer; `rollouts.py` holds the field
types they are made of), `service.py` (the sockets and the loop, `run`), `state.py` (its
bookkeeping: admission control, leases, groups, batches, resume; `rules.py` has the rules as plain
functions, `groups.py` a group's records), `store.py` (what it keeps on disk), `prompts.py` (the
prompts it leases), `eval.py` (evaluation beside the training stream), `client.py` (what the other
roles use to talk to it), `config.py` and `access.py` (who may ask what under CurveZMQ).

Imports nothing of the project but `common`.
"""
