"""Why torch's package loader crashes on the background worker's packages (issue 24, stop 46 on the H200): one decode
unit of a one-layer 0.5B-shaped decoder (the whole graph, attention ops inside) is packaged twice, in a start's
setup (``aot_background=False``) and by the background worker, and each package is then loaded in fresh processes:

- ``op``: a process that imports the op's module only (what the worker's loader crash was reproduced with);
- ``op+flashinfer``: that and FlashInfer (a warm start has imported it before it loads packages);
- under ``cuda-gdb`` (where it is installed), the first load that crashed, for its native backtrace.

    python scripts/package_load_probe.py OUTDIR

Prints one JSON line and writes it to OUTDIR/probe.json: each start's ``aot`` line and the worker's state, each load's
return code (-11 or 139: SIGSEGV) and last line, and the backtrace's frames. PIECEGRAPH_PROBE_DEVICE=cpu makes a dry
run (the torch attention backend, graphs emulated: every load should succeed there).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

OP_MODULE = "piecegraph.attention.op"


def start(root: str, inline: bool) -> None:
    """Child: set up the decode module with packages (in the setup, or in the background and wait)."""
    import dataclasses

    import torch

    import piecegraph
    from piecegraph.attention import KVCache
    from piecegraph.cache import wait_packaging
    from piecegraph.models import QWEN2_5_0_5B, Decoder, dummy_inputs

    cuda = os.environ.get("PIECEGRAPH_PROBE_DEVICE", "cuda") == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = dataclasses.replace(QWEN2_5_0_5B, num_layers=1)
    model = Decoder.random(shape, dtype=dtype, device=device)
    cache = KVCache.for_sequences(shape, 8, 64, dtype=dtype, device=device, backend="flashinfer" if cuda else "torch")
    module = piecegraph.compile(model, mode="full", capture_sizes=(1, 2, 4), cache_dir=root, aot_package=True,
                                aot_background=not inline, full_compile="whole", emulate_graphs=not cuda)
    module.capture(lambda n: dummy_inputs(model, cache, n))
    states = {} if inline else wait_packaging(root, timeout=300)
    print(json.dumps({"aot": module.stats()["startup"].get("aot"), "states": states}, default=str))


def load(modules: str, package: str) -> None:
    """Child: import ``modules`` (comma-separated), touch the GPU, then construct the loader as piecegraph does."""
    import importlib

    import torch

    for name in filter(None, modules.split(",")):
        importlib.import_module(name)
    index = 0 if torch.cuda.is_available() else -1
    if index >= 0:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    torch._C._aoti.AOTIModelPackageLoader(package, "model", True, 1, index)
    print("loaded")


def _run(args: list[str], timeout: float) -> dict:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": "timeout"}
    lines = (done.stdout + done.stderr).strip().splitlines()
    return {"rc": done.returncode, "last": lines[-1][:300] if lines else "", "stdout": done.stdout}


def _package(root: Path) -> Path | None:
    """The unit's package: the entry's, or the worker's scratch copy (left behind when the worker crashed)."""
    found = sorted(root.glob("entries/*/unit0.pt2")) + sorted(root.glob("scratch-*/unit0.pt2"))
    return found[0] if found else None


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    result: dict = {"starts": {}, "loads": {}}
    packages = {}
    for how in ("inline", "worker"):
        root = out / how
        shutil.rmtree(root, ignore_errors=True)
        ran = _run([*me, "start", str(root), how], 600)
        result["starts"][how] = {"rc": ran["rc"], "report": ran.get("stdout", "").strip()[-2000:] or ran.get("last")}
        packages[how] = _package(root)
    first_crash = None
    for how, package in packages.items():
        for imports in (OP_MODULE, f"flashinfer,{OP_MODULE}"):
            name = f"{how}/{'op' if imports == OP_MODULE else 'op+flashinfer'}"
            if package is None:
                result["loads"][name] = {"rc": "no package"}
                continue
            ran = _run([*me, "load", imports, str(package)], 300)
            result["loads"][name] = {k: ran.get(k) for k in ("rc", "last")}
            crashed = isinstance(ran["rc"], int) and (ran["rc"] < 0 or ran["rc"] > 128)  # by a signal
            if crashed and first_crash is None:
                first_crash = (imports, package)
    gdb = shutil.which("cuda-gdb")
    if first_crash and gdb:
        ran = _run([gdb, "-batch", "-ex", "run", "-ex", "bt 40", "--args", *me, "load", *map(str, first_crash)], 300)
        result["backtrace"] = [line for line in ran.get("stdout", "").splitlines() if line.startswith("#")][:40]
    line = json.dumps(result, default=str)
    (out / "probe.json").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    if sys.argv[1] == "start":
        start(sys.argv[2], sys.argv[3] == "inline")
    elif sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
