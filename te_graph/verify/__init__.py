"""The runtime verifier: at chosen calls, the same call is run again eagerly from the same
inputs, parameters and random state, leaving no trace, and its outputs and gradients are
compared with the graph's, bitwise. It checks the contract itself, whatever the class of
what might go wrong (``options``: when; ``shadow``: the eager run; ``compare``: the
comparison and its report; ``callable``: the graphed callable that verifies)."""
