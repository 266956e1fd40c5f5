"""Learner: losses, advantage estimators, the DeepSpeed engine and the training loops.

The model helpers (`learner.modeling`) are light (no DeepSpeed import) so that scorers,
generators and tests can use them.
"""
