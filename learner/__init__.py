"""Learner: losses, advantage estimators, the DeepSpeed engine and the training loops.

`learner.tiny_model` and the model helpers are light (no DeepSpeed import) so that scorers,
generators and tests can use them.
"""
