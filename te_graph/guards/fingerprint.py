"""The check at every call of a graphed callable: the process-wide settings its kernels were
chosen under, and the fingerprint of its module (``frozen``), taken when graphing ended."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..extension import SEAM
from .frozen import REGRAPH, FrozenModule
from .outside import OutsideReads
from .reads import SDPA
from .settings import Settings

__all__ = ["Fingerprint", "fingerprints"]


class Fingerprint:
    """What one graphed callable checks at each call: the settings, and its module's
    fingerprint where it is a module (shared by every graph of that module)."""

    __slots__ = ("name", "settings", "module", "outside")

    def __init__(self, name: str, settings: Settings, module: Optional[FrozenModule],
                 outside: Optional[OutsideReads] = None):
        self.name = name
        self.settings = settings
        self.module = module
        self.outside = outside  # globals and plain objects its forward read (None: none)

    def check(self) -> None:
        settings = self.settings
        module = self.module
        outside = self.outside
        if settings.read() == settings.captured and (module is None or module.matches()) and (
                outside is None or outside.matches()):
            return
        found = settings.changes() + (module.changes() if module is not None else []) + (
            outside.changes() if outside is not None else [])
        if found:
            raise RuntimeError(f"{self.name}: since graphing, {'; '.join(found)}. {REGRAPH}")


def fingerprints(specs: Sequence[Any], device_type: str, runtime: frozenset, reads: dict) -> list[Fingerprint]:
    """One fingerprint per graphed callable (``specs``: one ``records.GraphSpec`` each), taken
    when graphing has ended: what its forwards read (``reads``, per callable), less what an
    integration checks itself (``extension.Extension.keeps_own_state``)."""
    modules: dict[int, FrozenModule] = {}
    result = []
    for spec in specs:
        func, frozen = spec.func, None
        read = reads.get(spec.owner)
        if isinstance(func, torch.nn.Module):
            frozen = modules.get(id(func))
            if frozen is None:
                frozen = modules[id(func)] = FrozenModule(func, runtime, SEAM.keeps_own_state, spec.routed, read)
        sdpa = read is not None and SDPA in read.consults
        result.append(Fingerprint(spec.name, Settings(device_type, sdpa), frozen, OutsideReads.of(read)))
    return result
