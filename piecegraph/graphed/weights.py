"""Watching the parameters and buffers a GraphedModule's graphs read: one replaced (``model.fc.weight =
nn.Parameter(...)``) is re-read and the graphs captured again; one that changed shape, dtype or kind means the
trace no longer describes the model."""

from __future__ import annotations

import logging
import operator
import weakref
from typing import Any, Iterable

import torch

from ..runner.flat import FlatRunner
from .binding import Binding

log = logging.getLogger("piecegraph")


class _RegistrationHooks:
    """The live watches and torch's one global hook on parameter, buffer and submodule registration. Weak: it keeps
    nothing alive. Installed when the first GraphedModule is built, not at import."""

    def __init__(self) -> None:
        self.live: weakref.WeakSet[WeightWatch] = weakref.WeakSet()
        self.installed = False

    def add(self, watch: WeightWatch) -> None:
        if not self.installed:
            torch.nn.modules.module.register_module_parameter_registration_hook(self._on_registration)
            torch.nn.modules.module.register_module_buffer_registration_hook(self._on_registration)
            torch.nn.modules.module.register_module_module_registration_hook(self._on_registration)
            self.installed = True
        self.live.add(watch)

    def _on_registration(self, module: torch.nn.Module, name: str, value: Any) -> None:
        # A registration inside a forward Dynamo traces (a model that registers a buffer on first use) is the
        # trace's own: Dynamo would inline this loop and guard on the weak set's members by position, and a watch
        # collected before the guards are built failed the whole trace (IndexError in a guard).
        if torch.compiler.is_compiling():
            return
        for watch in list(self.live):
            watch.registered(module)


_HOOKS = _RegistrationHooks()  # with the op registry, the package's only registries


class WeightWatch:
    """The traced parameters and buffers of one model, by their Dynamo source names (``L['model']._modules[...]``).

    Active while a :class:`Binding` of a traced program is set (:meth:`bind`): calls then read parameters where
    the binding holds them, so a re-registered one must reach it. Registration hooks flag a re-registration;
    ``module.bias = None`` fires no hook, so :meth:`changed` also checks each traced slot (one dict lookup each).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.binding: Binding | None = None
        self.modules_seen: set[int] = set()
        self.slots: list[tuple[dict, str, Any]] = []  # (module._parameters or _buffers, name, tensor)
        self.stale = False
        self._columns_of: list | None = None
        self._columns_cache: tuple[tuple, tuple, tuple] = ((), (), ())
        _HOOKS.add(self)

    def bind(self, binding: Binding | None, traced: bool = True) -> None:
        """Watch ``binding``'s parameters (``traced``: read off the model by the trace; a breakable binding has
        none)."""
        self.binding = binding
        self.modules_seen = {id(m) for m in self.model.modules()} if traced else set()
        self.slots = self._parameter_slots() if traced else []

    def unbind(self) -> None:
        self.binding = None

    def registered(self, module: torch.nn.Module) -> None:
        if self.binding is not None and id(module) in self.modules_seen:
            self.stale = True

    def changed(self, runners: Iterable[FlatRunner]) -> bool:
        """Whether the model's structure changed since the trace (it must be traced again). A replaced parameter
        of the same shape, dtype and device is re-read instead, and ``runners`` capture again."""
        if self.binding is None:
            return False
        if not self.stale:
            # map() over the slots' columns: the check runs at C speed, once per call
            containers, keys, values = self._columns
            self.stale = not all(map(operator.is_, map(dict.get, containers, keys), values))
        return self.stale and not self.refresh(runners)

    def refresh(self, runners: Iterable[FlatRunner]) -> bool:
        """Re-read parameters and buffers by their source names after one (or a submodule) was re-registered;
        ``runners`` drop their graphs when one was replaced. Returns False when the model's structure changed (a
        parameter gone, a submodule of another kind, a shape or dtype changed)."""
        self.stale = False
        changed = []
        for bound in self.binding.module_inputs().values():
            name, old = bound.name, bound.value
            if not name.startswith("L['model']"):
                continue
            try:
                current = self._follow(name)
            except Exception:  # noqa: BLE001  (the path is gone: a submodule replaced by another kind)
                return False
            if current is old:
                continue
            if not isinstance(current, torch.Tensor) or (current.shape, current.dtype, current.device) != (
                    old.shape, old.dtype, old.device):
                return False
            bound.value = current
            changed.append(name)
        if changed:
            log.warning("piecegraph: %d parameters/buffers were replaced (%s...); capturing again", len(changed),
                        changed[0])
            for runner in runners:
                runner.drop_graphs()
        self.modules_seen = {id(m) for m in self.model.modules()}  # a new submodule is watched from now on
        self.slots = self._parameter_slots()
        return True

    @property
    def _columns(self) -> tuple[tuple, tuple, tuple]:
        """``slots`` as three columns (containers, names, tensors), rebuilt when ``slots`` is replaced."""
        if self._columns_of is not self.slots:
            self._columns_of, self._columns_cache = self.slots, tuple(zip(*self.slots)) or ((), (), ())
        return self._columns_cache

    def _follow(self, source: str) -> Any:
        """The object a Dynamo source name reaches from the model, e.g. ``L['model']._modules['x']._parameters``."""
        return eval(source, {"__builtins__": {}}, {"L": {"model": self.model}})

    def _parameter_slots(self) -> list[tuple[dict, str, Any]]:
        slots = []
        for bound in self.binding.module_inputs().values():
            container, _, key = bound.name.rpartition("[")
            if not bound.name.startswith("L['model']") or not container.endswith(("._parameters", "._buffers")):
                continue
            try:
                slots.append((self._follow(container), key.strip("]'\""), bound.value))
            except Exception:  # noqa: BLE001  (a name we cannot follow is watched by the hooks alone)
                continue
        return slots
