"""``piecegraph doctor TARGET``: the command line of the doctor.

TARGET is ``package.module:function`` or ``path/to/file.py:function``. The function takes no arguments (or a
``device`` argument, given the ``--device`` value) and returns ``(model, example_inputs)`` or a dict with keys
``model``, ``inputs`` and optionally ``context`` (forward-context metadata) and ``kwargs``. A file target is
loaded as a module named after the file, with its folder put on ``sys.path`` so its sibling packages import.
Exit status: 0 when nothing blocks tracing and capture, 1 when something does, 2 for a bad TARGET.
``piecegraph doctor --model PATH`` checks a local Hugging Face folder instead (``piecegraph.diagnose.hf_check``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import rich.markup
import torch
import typer
from rich.console import Console

from piecegraph.cli_common import check_writable

__all__ = ["doctor", "load_target", "Target"]

console = Console()


@dataclass
class Target:
    """What a TARGET function returned, normalized."""

    model: Callable
    inputs: tuple
    context: Any = None
    kwargs: dict = field(default_factory=dict)
    module: str = ""  # the module that defines the target function: the user's own code


def _import_file(path: Path) -> Any:
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so `import fakelib` next to the file works, as `python file.py` would
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.realpath(getattr(loaded, "__file__", "") or "") == str(path):
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise typer.BadParameter(f"cannot load {path} as a Python module", param_hint="TARGET")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _resolve(spec: str) -> Callable:
    where, sep, func = spec.rpartition(":")
    if not sep or not where or not func:
        raise typer.BadParameter(f"{spec!r} is not MODULE:FUNCTION or FILE.py:FUNCTION", param_hint="TARGET")
    try:
        if where.endswith(".py") or os.sep in where or "/" in where:
            path = Path(where).resolve()
            if not path.is_file():
                raise typer.BadParameter(f"no such file: {where}", param_hint="TARGET")
            module = _import_file(path)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` does: modules of the current folder import
            module = importlib.import_module(where)
    except typer.BadParameter:
        raise
    except Exception as err:  # noqa: BLE001  (a syntax error or a failing import is the target's, in one line)
        raise typer.BadParameter(f"cannot import {where!r}: {_one_line(err)}", param_hint="TARGET") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise typer.BadParameter(f"{where!r} has no function {func!r}", param_hint="TARGET")
    return fn


def _one_line(err: BaseException) -> str:
    """``Type: first line of the message (file:line)`` of the innermost frame."""
    message = (str(err).strip().splitlines() or [""])[0]
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})" if tb is not None else ""
    if isinstance(err, SyntaxError) and err.filename:
        where = f" ({err.filename}:{err.lineno})"
    return f"{type(err).__name__}: {message[:200]}{where}"


def _normalize(value: Any, module: str) -> Target:
    if isinstance(value, dict):
        if "model" not in value or "inputs" not in value:
            raise typer.BadParameter("the target returned a dict without 'model' and 'inputs'", param_hint="TARGET")
        model, inputs = value["model"], value["inputs"]
        context, kwargs = value.get("context"), dict(value.get("kwargs") or {})
    elif isinstance(value, tuple) and len(value) == 2:
        (model, inputs), context, kwargs = value, None, {}
    else:
        raise typer.BadParameter("the target must return (model, example_inputs) or a dict with 'model' and "
                                 "'inputs'", param_hint="TARGET")
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return Target(model, inputs, context, kwargs, module)


def _to_device(target: Target, device: str) -> None:
    # only when the target did not build for the device itself: the module and tensor inputs move
    if isinstance(target.model, torch.nn.Module):
        target.model.to(device)
    target.inputs = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in target.inputs)


def load_target(spec: str, device: Optional[str] = None) -> Target:
    """Import and call the TARGET function; see the module docstring."""
    fn = _resolve(spec)
    params = inspect.signature(fn).parameters
    takes_device = "device" in params
    required = [n for n, p in params.items() if p.default is p.empty and n != "device"
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise typer.BadParameter(f"{spec!r} needs arguments ({', '.join(required)}); a target takes none (or only "
                                 "device=)", param_hint="TARGET")
    try:
        value = fn(device=device) if takes_device and device is not None else fn()
    except Exception as err:  # noqa: BLE001  (the target's own failure, named in one line)
        raise typer.BadParameter(f"{spec!r} raised {_one_line(err)}", param_hint="TARGET") from None
    target = _normalize(value, getattr(fn, "__module__", "") or "")
    if device is not None and not takes_device:
        _to_device(target, device)
    return target


def doctor(
    target: Optional[str] = typer.Argument(None, help="package.module:function or path/to/file.py:function "
                                                      "returning (model, inputs) or {'model', 'inputs', 'context'}"),
    json_path: Optional[Path] = typer.Option(None, "--json", help="write the report as JSON (stable schema)"),
    html_path: Optional[Path] = typer.Option(None, "--html", help="write the report as one self-contained HTML file"),
    fix: bool = typer.Option(False, "--fix", help="apply the known fixes and trace again (before/after counts)"),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: where the target put the model)"),
    model: Optional[Path] = typer.Option(None, "--model", help="a local Hugging Face folder instead of TARGET: "
                                         "check that piecegraph.hf runs it exactly (exit 1 when refused)"),
    dtype: str = typer.Option("auto", "--dtype", help="with --model: auto (the checkpoint's) | float32 | "
                              "bfloat16 | float16"),
) -> None:
    """Name what blocks full-graph tracing or CUDA-graph capture of a model, where it comes from, and the fix;
    with --model PATH, whether piecegraph runs that Hugging Face folder exactly (and why not)."""
    from piecegraph.diagnose.core import EagerFailure
    from piecegraph.diagnose.core import doctor as run_doctor
    from piecegraph.diagnose.report import render, to_html

    if device not in (None, "cpu", "cuda"):
        raise typer.BadParameter(f"{device!r} is not cpu or cuda", param_hint="--device")
    if device == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("--device cuda, but torch sees no CUDA device", param_hint="--device")
    if (target is None) == (model is None):
        raise typer.BadParameter("give a TARGET or --model PATH (one of them)", param_hint="TARGET")
    if model is not None:
        from piecegraph.diagnose.hf_check import check_model_folder

        return check_model_folder(model, dtype, device, console)
    assert target is not None
    for flag, path in (("--json", json_path), ("--html", html_path)):
        check_writable(path, flag)
    loaded = load_target(target, device)
    top = (loaded.module or "").split(".")[0]
    try:
        report = run_doctor(loaded.model, *loaded.inputs, context=loaded.context, fix=fix, device=device,
                            kwargs=loaded.kwargs, user_packages=(top,) if top else ())
    except EagerFailure as err:
        console.print(f"[bold red]piecegraph doctor:[/] {rich.markup.escape(str(err))}")
        raise typer.Exit(2) from None
    render(report, console)
    if json_path:
        json_path.write_text(report.dumps())
        console.print(f"wrote {json_path}")
    if html_path:
        html_path.write_text(to_html(report))
        console.print(f"wrote {html_path}")
    if not report.ok:
        raise typer.Exit(1)
