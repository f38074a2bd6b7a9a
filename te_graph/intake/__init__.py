"""Intake: what a ``make_graphed_callables`` call asks, in one shape (call forms, Transformer
Engine's and torch's spellings, options, samples, the frozen specs of the graphs) and every
refusal made before anything changes."""
