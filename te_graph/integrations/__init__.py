"""How te_graph meets frameworks that call ``make_graphed_callables`` themselves.

* ``megatron``: megatron-core's ``TECudaGraphHelper`` (``--cuda-graph-impl
  transformer_engine``); ``te_graph.integrations.megatron.enable()``.
"""
