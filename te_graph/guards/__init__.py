"""Guards: what a graph froze of the model and the process, and its check at every call."""
