"""Where the cache lives: ``Config.cache_dir``, ``PIECEGRAPH_CACHE_DIR``, the user's cache folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ENV = "PIECEGRAPH_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$PIECEGRAPH_CACHE_DIR``, else ``$XDG_CACHE_HOME/piecegraph``, else ``~/.cache/piecegraph``."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "piecegraph"


def resolve_cache_dir(setting: Any) -> Path | None:
    """The folder ``Config.cache_dir`` names, or ``None`` for no cache.

    ``None``: ``$PIECEGRAPH_CACHE_DIR`` if set, else no cache (opt-in: a library must not write under the user's
    home or move Inductor's cache dir unasked); ``True``: :func:`default_cache_dir`; ``False``: none; a path: it.
    """
    if setting is None:
        return Path(os.environ[ENV]).expanduser() if os.environ.get(ENV) else None
    if setting is False:
        return None
    if setting is True:
        return default_cache_dir()
    return Path(setting).expanduser()
