"""Execution: the model runner (one forward pass per step), the sampler, the model loader and the model implementations."""
