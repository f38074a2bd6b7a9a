"""The frameworks te_graph serves beyond plain PyTorch, each a package here that registers
with the engine's one seam (``te_graph.extension``) when imported: Transformer Engine
(``transformer_engine``) and megatron-core (``megatron``). ``te_graph`` imports every
package present, so deleting one leaves the engine and the others working. None imports
its framework until it is used."""
from __future__ import annotations

import importlib
import pkgutil

__all__: list[str] = []

for _found in pkgutil.iter_modules(__path__):
    if _found.ispkg:
        importlib.import_module(f"{__name__}.{_found.name}")
