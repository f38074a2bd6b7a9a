"""What one ``make_graphed_callables`` call's warmup and capture share: the options they
run with, and the state they hold while they run (``CaptureSession``), made once in
``prepare.prepare_graphs`` and passed whole."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .host_state import HostState
from .input_updates import InputUpdates
from .module_state import ModuleState
from .parameters import StandIns

__all__ = ["CaptureOptions", "CaptureSession"]


@dataclass(frozen=True)
class CaptureOptions:
    """How to warm up and capture (everything but the specs and their schedule)."""

    num_warmup_iters: int
    allow_unused_input: bool
    reuse_buffers: bool
    pool: Any
    tracker: Any
    eager_replay: bool
    capture_error_mode: str = "thread_local"
    chain_grads: bool = False  # plain schedule: layer i reads layer i+1's input-grad buffer
    has_order: bool = False  # an order (TE's _order) places the weight-gradient passes
    pre_warmup_hook: Optional[Callable[[], None]] = None
    post_warmup_hook: Optional[Callable[[], None]] = None
    precision: Any = None  # the registered precision's options (``extension.Precision.options``)

    @property
    def passes(self) -> int:
        """Warmup passes: eager replay makes one more where graphs capture, so that both see
        a forward's Python side effects as often (``ModuleState``)."""
        return self.num_warmup_iters + (1 if self.eager_replay else 0)

    @property
    def finds_saved(self) -> bool:
        """Whether the last warmup pass finds the outputs each backward reads: it must not be
        the first (with one pass every output counts as read)."""
        return self.num_warmup_iters >= 2


@dataclass(frozen=True)
class CaptureSession:
    """The state warmup and capture hold while they run, put back when they end."""

    stand_ins: StandIns  # the parameters' stand-ins, installed in the modules
    state: ModuleState  # the modules' buffers and attributes, compared after each pass
    updates: InputUpdates  # inputs the forwards update in place
    host: HostState  # the host's random streams and the tensors outside the modules
    precision: Any = None  # the precision's capture steps (``extension.Precision.capture``), or None
    reads: dict = field(default_factory=dict)  # per callable (owner): what its forwards read (``guards.reads``)
