"""Whole-step graphs: a training step (every microbatch's forward and backward, gradient
accumulation, optionally the optimizer) captured as one graph, with the same RNG contract,
guards, verifier and eager-replay mirror as per-layer graphs (``graphed_step``)."""
