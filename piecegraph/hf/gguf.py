"""A GGUF file (llama.cpp's single-file format) as a Hugging Face checkpoint folder, written once and reused.

transformers reads GGUF itself (through the ``gguf`` package, with ``accelerate``), dequantizing the weights to
float32, but refuses to ``save_pretrained`` such a model; a plain model rebuilt from its config with the loaded
weights saves as any checkpoint does. The folder then loads like every other (``piecegraph.hf.load``,
``piecegraph serve FOLDER``), tokenizer and chat template included.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from piecegraph.cache.paths import default_cache_dir


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file named ``*.gguf``."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" and path.is_file()


def gguf_folder_path(path: str | Path, cache_root: str | Path | None = None) -> Path:
    """Where :func:`gguf_folder` keeps the folder of ``path``: ``<cache_root>/gguf/<stem>-<key>``, the key a hash
    of the file's absolute path, size and modification time (a changed file gets a new folder). ``cache_root``
    default: piecegraph's cache folder (``$PIECEGRAPH_CACHE_DIR``, else the user's cache folder)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(cache_root) if cache_root is not None else default_cache_dir()
    return root / "gguf" / f"{path.stem}-{key}"


def gguf_folder(path: str | Path, cache_root: str | Path | None = None) -> tuple[Path, bool]:
    """``(folder, converted)``: the Hugging Face checkpoint folder of the GGUF file ``path`` (config, generation
    config, float32 safetensors weights, tokenizer with its chat template) and whether this call wrote it
    (``False``: an earlier call's folder, reused). Written into a temporary folder beside its place and renamed,
    so a folder that exists is complete. Local files only. Raises ``FileNotFoundError`` for a missing file,
    ``ImportError`` naming ``gguf`` / ``accelerate`` / ``transformers`` when one is missing, and transformers'
    ``ValueError`` for an architecture it cannot read from GGUF."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file")
    folder = gguf_folder_path(path, cache_root)
    if (folder / "config.json").is_file():
        return folder, False
    try:
        import accelerate  # noqa: F401  (transformers needs it for GGUF; say so before minutes of work)
        import gguf  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise ImportError(f"reading a GGUF file needs transformers, gguf and accelerate ({err.name} is missing): "
                          "pip install 'piecegraph[hf]' gguf accelerate") from err
    source = {"pretrained_model_name_or_path": path.resolve().parent, "gguf_file": path.name}
    tokenizer = AutoTokenizer.from_pretrained(**source)
    loaded = AutoModelForCausalLM.from_pretrained(**source)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights saved are float: the folder is no GGUF checkpoint
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    del loaded
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        plain.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        try:
            os.rename(scratch, folder)
        except OSError:  # another process finished the same folder first: keep theirs
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder, True


__all__ = ["gguf_folder", "gguf_folder_path", "is_gguf"]
