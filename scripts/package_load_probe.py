"""Why torch's package loader crashes on the background worker's packages (issue 24, stop 46 on the H200), in one
device call. A one-layer 0.5B-shaped decoder's decode unit (the whole graph, attention ops inside) is packaged in a
start's setup (``inline``, ``aot_background=False``) and by the background worker (``worker``), and its prefill
pieces (no attention op: checked on real examples) by the worker too (``worker_prefill``). Then, most telling first:

- each package loaded in a fresh process after importing the op's module only (``op``: how the crash was
  reproduced); one that crashes, again with FlashInfer imported too (``op+flashinfer``: a warm start has it) and
  with Inductor's code cache (``op+inductor``: a process that compiled has it);
- the first load that crashed, under ``cuda-gdb`` (where installed), for its native backtrace;
- the workers' jobs (copied as the start hands them over) packaged again in fresh processes, each one way, and
  loaded in another: the prefill piece after compiling and running it with Inductor in that process
  (``jit_run_first``: a setup packages kernels it has compiled and tuned already) and without (``plain``); the
  decode unit with grad mode on (``grad``: as the worker built until stop 47; it now builds under no_grad, as a
  setup does), under the Python dispatcher (``pydispatch``: as a setup packages a piecewise program's pieces) and
  with an empty Inductor cache (``fresh_cache``);
- the packages' text files (the generated C++ wrapper and kernels, their JSON) compared: each decode package
  against the inline one, each prefill package against ``jit_run_first``'s (``OUTDIR/diff_*.txt``; file lists in
  the JSON).

    python scripts/package_load_probe.py OUTDIR
    python scripts/package_load_probe.py tiny PACKAGE           # one small function packaged
    python scripts/package_load_probe.py load MODULES PACKAGE   # torch, then MODULES (comma-separated), then the load

Prints one JSON line and writes it to OUTDIR/probe.json after every step: each start's ``aot`` line and the
worker's state, each load's return code (-11 or 139: SIGSEGV) and last line, each rebuild, the backtrace's frames,
and the steps skipped once PROBE_BUDGET_S (default 540 s) was spent. PIECEGRAPH_PROBE_DEVICE=cpu makes a dry run
(the torch attention backend, graphs emulated: every load should succeed there).
"""

from __future__ import annotations

import difflib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

OP_MODULE = "piecegraph.attention.op"


def start(root: str, how: str) -> None:
    """Child: set up the decode module (``how``: ``inline``, packaged in the setup; ``worker``, in the background,
    waited for) or a piecewise prefill module packaged in the background (``worker_prefill``: its pieces hold no
    attention op, so they are checked on real examples and can be run before packaging)."""
    inline = how == "inline"
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
    mode = {"mode": "piecewise", "capture_sizes": (4, 16)} if how == "worker_prefill" else \
        {"mode": "full", "capture_sizes": (1, 2, 4), "full_compile": "whole"}
    module = piecegraph.compile(model, cache_dir=root, aot_package=True, aot_background=not inline,
                                emulate_graphs=not cuda, **mode)
    module.capture(lambda n: dummy_inputs(model, cache, n))
    jobs = Path(root) / "jobs"  # the worker's job, kept for the builds below (the worker deletes it when it ends)
    for job in Path(root).glob("packaging/*.job"):
        jobs.mkdir(exist_ok=True)
        shutil.copy(job, jobs / job.name)
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


def tiny(package: str) -> None:
    """Child: one small CUDA function (an RMS norm) exported with its row count dynamic and packaged, in a process
    that imports nothing but torch: the loader's crash needs no op of piecegraph's (prefill pieces crashed too)."""
    import torch

    class Norm(torch.nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    x = torch.randn(8, 64, device="cuda" if torch.cuda.is_available() else "cpu")  # CPU: a dry run of the part
    exported = torch.export.export(Norm(), (x,), dynamic_shapes=({0: torch.export.Dim("rows", min=1)},))
    torch._inductor.aoti_compile_and_package(exported, package_path=package)
    print("built")


def build(variant: str, job_file: str, folder: str) -> None:
    """Child: package the first unit of the worker's job as ``variant`` says, without loading it."""
    import contextlib
    import importlib
    import tempfile

    if variant == "fresh_cache":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="probe-inductor-")
    header, payload = pickle.loads(Path(job_file).read_bytes())
    for name in header["modules"]:
        importlib.import_module(name)
    import torch
    from torch._dispatch.python import enable_python_dispatcher

    from piecegraph.cache.session import inductor_dir
    from piecegraph.trace.aot_job import build_package

    unit = pickle.loads(payload).units[0]
    where = contextlib.nullcontext() if variant == "fresh_cache" else inductor_dir(Path(header["root"]))
    with where, enable_python_dispatcher() if variant == "pydispatch" else contextlib.nullcontext(), \
            torch.set_grad_enabled(variant == "grad"):
        if variant == "jit_run_first":  # as a setup packages: its kernels compiled and tuned in this process
            from piecegraph.trace.aot_job import example_tensor

            args = [example_tensor(spec) for spec in unit.inputs]
            for arg, spec in zip(args, unit.inputs):
                for dim in spec.dims:
                    torch._dynamo.mark_dynamic(arg, dim)
            torch.compile(unit.graph, backend="inductor")(*args)
        build_package(unit, Path(folder))
    print(Path(folder) / unit.spec.file)


def _texts(package: Path) -> dict[str, str]:
    """The package's text members by kind (hashes in their names masked): what to compare between builds."""
    out = {}
    with zipfile.ZipFile(package) as z:
        for name in z.namelist():
            if name.endswith((".cpp", ".json", ".h")):
                kind = re.sub(r"[0-9a-z]{20,}", "H", name)
                out[kind] = re.sub(r"[0-9a-z]{20,}", "H", z.read(name).decode(errors="replace"))
    return out


def _compare(out: Path, packages: dict[str, Path | None]) -> dict:
    """Each package's members (name -> bytes) and, per other package, how its text members differ from the
    inline one's (lines changed, diff written to ``out/diff_NAME.txt``)."""
    found = {how: p for how, p in packages.items() if p is not None}
    result: dict = {"members": {how: {i.filename: i.file_size for i in zipfile.ZipFile(p).infolist()}
                                for how, p in found.items()}}
    if "inline" not in found:
        return result
    base = _texts(found["inline"])
    for how, package in found.items():
        if how == "inline":
            continue
        other, lines = _texts(package), []
        for kind in sorted(set(base) | set(other)):
            lines += difflib.unified_diff(base.get(kind, "").splitlines(), other.get(kind, "").splitlines(),
                                          f"inline/{kind}", f"{how}/{kind}", lineterm="", n=1)
        (out / f"diff_{how}.txt").write_text("\n".join(lines[:4000]) + "\n")
        result[f"changed_lines_{how}"] = sum(1 for line in lines if line[:1] in "+-" and line[:3] not in "+++---")
    return result


def _run(args: list[str], timeout: float) -> dict:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": "timeout"}
    lines = (done.stdout + done.stderr).strip().splitlines()
    return {"rc": done.returncode, "last": lines[-1][:300] if lines else "", "stdout": done.stdout}


def _package(root: Path) -> Path | None:
    """The first unit's package: the entry's, or the worker's scratch copy (left behind when the worker crashed)."""
    found = sorted(root.glob("entries/*/unit0.pt2")) + sorted(root.glob("scratch-*/unit0.pt2"))
    return found[0] if found else None


def _crashed(ran: dict) -> bool:
    return isinstance(ran["rc"], int) and (ran["rc"] < 0 or ran["rc"] > 128)  # ended by a signal


def main(out_dir: str) -> None:
    """The steps, most telling first, each skipped once PROBE_BUDGET_S (default 540: one device call) is spent;
    the JSON is written after every step, so a call cut short still brings back what ran."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, str(Path(__file__).resolve())]
    began, budget = time.monotonic(), float(os.environ.get("PROBE_BUDGET_S", "540"))
    result: dict = {"starts": {}, "loads": {}, "builds": {}, "skipped": []}
    packages: dict[str, Path | None] = {}

    def step(name: str) -> bool:
        if time.monotonic() - began > budget:
            result["skipped"].append(name)
            return False
        return True

    def save() -> None:
        result["elapsed_s"] = round(time.monotonic() - began, 1)
        (out / "probe.json").write_text(json.dumps(result, default=str) + "\n")

    for how in ("inline", "worker", "worker_prefill"):
        if step(f"start {how}"):
            root = out / how
            shutil.rmtree(root, ignore_errors=True)
            ran = _run([*me, "start", str(root), how], 600)
            report = ran.get("stdout", "").strip()[-2000:] or ran.get("last")
            result["starts"][how] = {"rc": ran["rc"], "report": report}
            packages[how] = _package(root)
            save()
    first_crash, crashed = None, set()
    # Each package after the op module only (as the crash was reproduced); one that crashes then again with
    # FlashInfer imported (as a warm start has it) and with Inductor's code cache imported (a start that compiled)
    for imports, label in ((OP_MODULE, "op"), (f"flashinfer,{OP_MODULE}", "op+flashinfer"),
                           (f"torch._inductor.codecache,{OP_MODULE}", "op+inductor")):
        for how in ("inline", "worker", "worker_prefill"):
            name = f"{how}/{label}"
            if packages.get(how) is None or (label != "op" and how not in crashed) or not step(f"load {name}"):
                continue
            ran = _run([*me, "load", imports, str(packages[how])], 300)
            result["loads"][name] = {k: ran.get(k) for k in ("rc", "last")}
            if _crashed(ran):
                crashed.add(how)
                first_crash = first_crash or (imports, packages[how])
            save()
    gdb = shutil.which("cuda-gdb")
    if first_crash and gdb and step("backtrace"):
        ran = _run([gdb, "-batch", "-ex", "run", "-ex", "bt 40", "--args", *me, "load", *map(str, first_crash)], 300)
        result["backtrace"] = [line for line in ran.get("stdout", "").splitlines() if line.startswith("#")][:40]
        save()
    for job_of, variant in (("worker_prefill", "jit_run_first"), ("worker_prefill", "plain"), ("worker", "grad"),
                            ("worker", "pydispatch"), ("worker", "fresh_cache")):
        jobs = sorted((out / job_of / "jobs").glob("*.job"))
        name = f"{job_of}/{variant}"
        if not jobs or not step(f"build {name}"):
            continue
        folder = out / "builds" / job_of / variant
        shutil.rmtree(folder, ignore_errors=True)
        ran = _run([*me, "build", variant, str(jobs[0]), str(folder)], 600)
        built = next(folder.glob("*.pt2"), None)
        loaded = _run([*me, "load", OP_MODULE, str(built)], 300) if built else {"rc": "not built"}
        result["builds"][name] = {"build_rc": ran["rc"], "build_last": ran.get("last"),
                                  "load_rc": loaded["rc"], "load_last": loaded.get("last")}
        packages[variant if job_of == "worker" else f"prefill_{variant}"] = built
        save()
    result["compare"] = _compare(out, {k: v for k, v in packages.items() if "prefill" not in k})
    result["compare_prefill"] = _compare(out, {"inline" if k == "prefill_jit_run_first" else k: v
                                               for k, v in packages.items() if "prefill" in k})
    save()
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    if sys.argv[1] == "start":
        start(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "tiny":
        tiny(sys.argv[2])
    elif sys.argv[1] == "build":
        build(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main(sys.argv[1])
