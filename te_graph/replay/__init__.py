"""Replay: what runs at every call of a graphed callable: the callable itself, the autograd
Function, the runners (graphs and eager replay), the per-call refusals, the order the graphs
of one pool may replay in, and the outputs handed out."""
