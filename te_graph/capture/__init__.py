"""Capture: warmup, the capture of each graph into one memory pool, the random streams of
recompute inside graphs, parameter stand-ins, module state kept as it was, and host-sync
detection (``prepare.prepare_graphs`` tells the algorithm top to bottom)."""
