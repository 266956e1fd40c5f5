"""The vLLM backend.

Reading order: `engine.py` (the offline `LLM` and the `AsyncLLM` engines a generator drives),
`worker.py` (the worker extension vLLM loads into each of its workers: it joins a weight round and
receives the buckets), `load.py` (how a received round is loaded into the running model).
"""
