"""The one result schema every benchmark runner writes, its checked loader, and the committed file name.

A result file is one JSON object::

    {"benchmark": "bench" | "serve-bench" | ...,      # which runner or script measured it
     "env": {"gpu", "torch", "flashinfer", "attention", "model", "dtype", "quant", "world_size", "date",
             "commit", ...},                           # the run's identity; more keys allowed
     "rows": [{...}, ...],                             # the measurements, one flat object per cell
     ...}                                              # extra top-level keys only where a runner needs them

``env`` always has the keys of :data:`REQUIRED_ENV`: ``gpu`` is the device name (``"NVIDIA H100 80GB HBM3"``, or
``"cpu"``), ``torch`` torch's version, ``flashinfer`` FlashInfer's version (``null``: not installed, or not
recorded), ``attention`` the attention backend the run used (``torch`` | ``flashinfer``; ``null`` where no paged
attention ran), ``model`` / ``dtype`` / ``quant`` what ran (``null`` where the benchmark has no model),
``world_size`` the tensor-parallel ranks (1 alone), ``date`` the day of the run (``YYYY-MM-DD``) and ``commit``
piecegraph's git short hash (``null`` outside a git checkout). A row is an object whose values are numbers,
strings, booleans or ``null``; nested objects and lists are allowed where a cell has parts (a serving row's steps
by graph kind), and :mod:`piecegraph.results.report` shows the scalar ones.

This module imports nothing from piecegraph, so every stage (runners, scripts, tests) can use it; torch is
imported only by :func:`environment`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Each required env key and the JSON types its value may have (None: null).
REQUIRED_ENV: dict[str, tuple[type | None, ...]] = {
    "gpu": (str,), "torch": (str,), "flashinfer": (str, None), "attention": (str, None), "model": (str, None),
    "dtype": (str, None), "quant": (str, None), "world_size": (int,), "date": (str,), "commit": (str, None),
}
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
# The committed file name: <date>_<gpu>_<what>.json, all lowercase
NAME = re.compile(r"(?P<date>\d{4}-\d{2}-\d{2})_(?P<gpu>[a-z0-9]+)_(?P<what>[a-z0-9]+(?:[_-][a-z0-9]+)*)\.json")


class SchemaError(ValueError):
    """A file or payload that is not in the result schema; the message names the file and the key."""


@dataclass
class Result:
    """One loaded result: ``benchmark``, ``env``, ``rows`` and the ``extra`` top-level keys (empty when none);
    ``path`` is the file it came from (``None`` for a payload checked in memory)."""

    benchmark: str
    env: dict[str, Any]
    rows: list[dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this result: ``benchmark``, ``env``, ``rows``, then the extra keys."""
        return {"benchmark": self.benchmark, "env": self.env, "rows": self.rows, **self.extra}


def _type_names(types: tuple[type | None, ...]) -> str:
    return " or ".join("null" if t is None else {str: "a string", int: "an int"}[t] for t in types)


def check(data: Any, source: str = "<payload>") -> Result:
    """``data`` (a parsed JSON value) as a :class:`Result`, or :class:`SchemaError` naming ``source`` and the first
    key that is missing or of the wrong type. Checks the top level, every required env key (types, and the date's
    form) and that ``rows`` is a list of objects; more env keys and extra top-level keys are allowed."""
    if not isinstance(data, dict):
        raise SchemaError(f"{source}: a result is a JSON object with benchmark, env and rows; got a "
                          f"{type(data).__name__}")
    for key in ("benchmark", "env", "rows"):
        if key not in data:
            hint = " (a file from before the one result schema?)" if key == "benchmark" else ""
            raise SchemaError(f"{source}: missing top-level key {key!r}{hint}")
    if not isinstance(data["benchmark"], str) or not data["benchmark"]:
        raise SchemaError(f"{source}: 'benchmark' must be a non-empty string, got {data['benchmark']!r}")
    env = data["env"]
    if not isinstance(env, dict):
        raise SchemaError(f"{source}: 'env' must be an object, got {type(env).__name__}")
    for key, types in REQUIRED_ENV.items():
        if key not in env:
            raise SchemaError(f"{source}: missing env key {key!r} (env needs {', '.join(REQUIRED_ENV)})")
        value = env[key]
        ok = any(value is None if t is None else isinstance(value, t) and not isinstance(value, bool)
                 for t in types)
        if not ok:
            raise SchemaError(f"{source}: env.{key} must be {_type_names(types)}, got {value!r}")
    if not DATE.fullmatch(env["date"]):
        raise SchemaError(f"{source}: env.date must be YYYY-MM-DD, got {env['date']!r}")
    rows = data["rows"]
    if not isinstance(rows, list):
        raise SchemaError(f"{source}: 'rows' must be a list of objects, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise SchemaError(f"{source}: rows[{i}] must be an object, got {type(row).__name__}")
    extra = {k: v for k, v in data.items() if k not in ("benchmark", "env", "rows")}
    return Result(data["benchmark"], env, rows, extra)


def load_result(path: str | Path) -> Result:
    """Read and check one result file (:func:`check`); :class:`SchemaError` names the file and what is wrong (not
    JSON, a missing or mistyped key). The returned :class:`Result` has ``path`` set."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise SchemaError(f"{path}: not JSON ({err})") from None
    result = check(data, str(path))
    result.path = path
    return result


def write_result(path: str | Path, benchmark: str, env: dict[str, Any], rows: list[dict[str, Any]],
                 **extra: Any) -> Path:
    """Check and write one result file (parent folders made; written to a temporary file and renamed, so a reader
    never sees half a file, and a runner may rewrite it after each mode). ``extra`` are extra top-level keys; values
    JSON cannot hold are written as their ``str``. Raises :class:`SchemaError` naming ``path`` when the payload is
    not in the schema (nothing is written then)."""
    path = Path(path)
    payload = json.loads(json.dumps({"benchmark": benchmark, "env": env, "rows": rows, **extra}, default=str))
    check(payload, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def device_name(device: Any = None) -> str:
    """The ``env.gpu`` of a run on ``device`` (a ``torch.device``, ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or ``None``:
    the current CUDA device when there is one): the GPU's name, or ``"cpu"``."""
    import torch

    kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(torch.device(device) if device is not None else None)


def flashinfer_version() -> str | None:
    """FlashInfer's installed version from the package metadata (FlashInfer itself is not imported), or ``None``."""
    from importlib import metadata

    for dist in ("flashinfer-python", "flashinfer"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def git_commit() -> str | None:
    """piecegraph's git short hash when it runs from a git checkout (the folder above the package holds ``.git``),
    else ``PIECEGRAPH_COMMIT`` from the environment (a copy of a commit's tree without its history, such as one
    sent to a GPU machine, names its commit so), else ``None`` (an installed wheel)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return os.environ.get("PIECEGRAPH_COMMIT") or None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def environment(*, attention: str | None, model: str | None, dtype: Any, quant: str | None, world_size: int = 1,
                **extra: Any) -> dict[str, Any]:
    """A result's ``env``: ``gpu`` (:func:`device_name` of the current device), ``torch``, ``flashinfer``
    (:func:`flashinfer_version`), ``date`` (today) and ``commit`` (:func:`git_commit`) read from this process, the
    run's ``attention`` / ``model`` / ``dtype`` (a ``torch.dtype`` is written without its ``torch.`` prefix) /
    ``quant`` / ``world_size`` as given, then ``extra`` (which may also override any of the read keys, e.g.
    ``gpu="cpu"`` for a CPU run on a GPU machine)."""
    import torch

    env: dict[str, Any] = {
        "gpu": extra.pop("gpu") if "gpu" in extra else device_name(),
        "torch": torch.__version__, "flashinfer": flashinfer_version(), "attention": attention, "model": model,
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."), "quant": quant,
        "world_size": int(world_size), "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
    }
    env.update(extra)
    return env


def gpu_short(gpu: str) -> str:
    """The GPU part of a result's file name: ``"NVIDIA H100 80GB HBM3"`` -> ``h100``, ``"NVIDIA H200"`` ->
    ``h200``, ``"NVIDIA GeForce RTX 4090"`` -> ``rtx4090``, ``"cpu"`` -> ``cpu``: the first word that names a
    model (letters and digits), lowercase."""
    words = [w for w in re.split(r"[\s_/-]+", gpu.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    for i, word in enumerate(words):
        plain = re.sub(r"[^a-z0-9]", "", word)
        if re.search(r"[a-z]", plain) and re.search(r"\d", plain):
            return plain
        if plain.isdigit() and i and words[i - 1].isalpha():  # "rtx 4090"
            return words[i - 1] + plain
    joined = re.sub(r"[^a-z0-9]", "", "".join(words))
    return joined or "unknown"


def result_name(env: dict[str, Any], what: str) -> str:
    """``<date>_<gpu>_<what>.json``: the name a result is committed under in ``benchmarks/results/``, e.g.
    ``2026-12-05_h100_serve_every_mode.json``. ``gpu`` is :func:`gpu_short` of ``env["gpu"]``; ``what`` says what was
    measured (lowercased, other characters than letters, digits, ``_`` and ``-`` become ``_``); it must not be
    empty. ``env`` needs ``date`` and ``gpu``."""
    slug = re.sub(r"[^a-z0-9-]+", "_", what.lower()).strip("_-")
    slug = re.sub(r"[_-]{2,}", "_", slug)
    if not slug:
        raise ValueError(f"result_name: {what!r} leaves no name (letters or digits needed)")
    name = f"{env['date']}_{gpu_short(str(env['gpu']))}_{slug}.json"
    if not NAME.fullmatch(name):
        raise ValueError(f"result_name: {name!r} is not <YYYY-MM-DD>_<gpu>_<what>.json")
    return name
