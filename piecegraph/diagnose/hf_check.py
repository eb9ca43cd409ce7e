"""``piecegraph doctor --model PATH``: whether piecegraph runs a Hugging Face checkpoint folder exactly.

The same checks a load makes (:func:`piecegraph.hf.check_folder`): the config (decoder-only, attention layers
only, causal), the built model (layers and attention where the flat forward reaches them), then the numeric
self-check (a probe prompt through piecegraph's attention against the model's own forward). Prints the verdict;
exit status 0 when supported, 1 when refused, 2 for a folder that is not a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import rich.markup
import torch
import typer
from rich.console import Console

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_folder(path: Path, dtype: str, device: str | None, console: Console) -> None:
    """Run the checks on ``path`` and print the verdict; raises ``typer.Exit(1)`` when it is refused."""
    if dtype not in DTYPES:
        raise typer.BadParameter(f"{dtype!r} is not one of {', '.join(DTYPES)}", param_hint="--dtype")
    if not (path / "config.json").is_file():
        raise typer.BadParameter(f"{path} has no config.json: expected a Hugging Face checkpoint folder",
                                 param_hint="--model")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise typer.BadParameter("checking a Hugging Face folder needs transformers: pip install 'piecegraph[hf]'",
                                 param_hint="--model") from None
    from piecegraph.hf import check_folder

    with console.status(f"checking {path}: loading, then a probe prompt through piecegraph's attention"):
        verdict = check_folder(path, dtype=DTYPES[dtype], device=device or "cpu")
    if verdict.ok:
        console.print(f"[green]{rich.markup.escape(verdict.summary())}[/]")
        return
    console.print(f"[bold red]{rich.markup.escape(verdict.summary())}[/]")
    raise typer.Exit(1)
