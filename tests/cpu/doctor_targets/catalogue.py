"""The doctor's catalogue: one tiny target per category, each returning ``(model, example_inputs)``.

Library findings come from ``fakelib`` (a fake package next to this file) and ``jitlib`` (the CPU JIT fixture);
user findings from the models below. ``EXPECTED`` says what the doctor must report for each.
"""

import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):  # fakelib lives here, jitlib one folder up
    if _path not in sys.path:
        sys.path.insert(0, _path)

import fakelib  # noqa: E402
import jitlib  # noqa: E402


class Calls(torch.nn.Module):
    """A linear layer, then ``fn`` applied ``times`` times: the break re-runs that often per forward."""

    def __init__(self, fn, times: int = 1):
        super().__init__()
        self.fn, self.times = fn, times
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        for _ in range(self.times):
            y = self.fn(y)
        return y


class ItemModel(torch.nn.Module):
    def forward(self, x):
        return x * x.sum().item()


class BreakModel(torch.nn.Module):
    def forward(self, x):
        y = x + 1
        torch._dynamo.graph_break()
        return y * 2


class JitModel(torch.nn.Module):
    """Calls the JIT fixture's public op: its cached loader stats, runs cc, locks and calls through ctypes."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return jitlib.scaled_add(y, y, 0.5)


class Clean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


def _x():
    return (torch.randn(4, 8),)


def filesystem():
    return Calls(fakelib.scale, times=2), _x()


def subprocess_():
    return Calls(fakelib.shell_gelu), _x()


def decorated():
    return Calls(fakelib.logged_gelu), _x()


def lock():
    return Calls(fakelib.add_bias), _x()


def file_io():
    return Calls(fakelib.lookup), _x()


def clock():
    return Calls(fakelib.timed), _x()


def ffi_call():
    return Calls(fakelib.labs_scale), _x()


def print_logging():
    return Calls(fakelib.quiet), _x()


def numpy_():
    return Calls(fakelib.noise), _x()


def unsupported_builtin():
    return Calls(fakelib.sized), _x()


def data_dependent():
    return {"model": ItemModel(), "inputs": _x()}


def other():
    return {"model": BreakModel(), "inputs": _x()}


def jit():
    return JitModel(), _x()


def clean():
    return Clean(), _x()


# target -> (category, package, entry, loader, loader warm, count per forward)
EXPECTED = {
    "filesystem": ("filesystem", "fakelib", "fakelib.scale", "fakelib.config", True, 2),
    "subprocess_": ("subprocess", "fakelib", "fakelib.shell_gelu", None, None, 1),
    "decorated": ("subprocess", "fakelib", "fakelib.logged_gelu", None, None, 1),
    "lock": ("lock", "fakelib", "fakelib.add_bias", None, None, 1),
    "file_io": ("file_io", "fakelib", "fakelib.lookup", None, None, 1),
    "clock": ("clock", "fakelib", "fakelib.timed", None, None, 1),
    "ffi_call": ("ffi_call", "fakelib", "fakelib.labs_scale", None, None, 1),
    "print_logging": ("print_logging", "fakelib", "fakelib.quiet", None, None, 1),
    "numpy_": ("numpy", "fakelib", "fakelib.noise", None, None, 1),
    "unsupported_builtin": ("unsupported_builtin", "fakelib", "fakelib.sized", None, None, 1),
    "data_dependent": ("data_dependent", "user", "catalogue.ItemModel.forward", None, None, 1),
    "other": ("other", "user", "catalogue.BreakModel.forward", None, None, 1),
    "jit": ("filesystem", "jitlib", "jitlib.scaled_add", "jitlib.get_kernel_module", True, 1),
}
