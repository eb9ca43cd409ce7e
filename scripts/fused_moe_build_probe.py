"""How long FlashInfer's first JIT build of its sm90 fused MoE (``cutlass_fused_moe``) takes, and what
``use_fast_build`` changes (issue 23). Usage: ``python3 scripts/fused_moe_build_probe.py OUT.json SECONDS``.

Writes both build files (``use_fast_build`` False, then True; the two share one module name and folder), records
which compiler flags carry ``-DFAST_BUILD`` and how many translation units each compiles, then runs FlashInfer's
own ninja command on the fast one for at most SECONDS (killed after) and reads ninja's log: each finished object's
compile seconds. From those it estimates the whole build's serial seconds and its wall time at the jobs used. The
build cannot finish inside one device call when the estimate says so; that is the point of the probe.
CUDA machine with nvcc and FlashInfer only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


def build_file_facts(text: str) -> dict:
    """The flags lines and the objects a ninja file builds."""
    flags = {name: "-DFAST_BUILD" in line for line in text.splitlines()
             for name in ("cflags", "cuda_cflags") if line.startswith(name + " =")}
    objects = re.findall(r"^build (\S+\.o):", text, flags=re.M)
    return {"fast_build_in": flags, "objects": len(objects),
            "cuda_objects": sum(o.endswith(".cuda.o") for o in objects)}


def finished(log: Path, folder: str) -> dict[str, float]:
    """Seconds per object of ``folder`` that ninja's log says finished (``start end mtime target hash``)."""
    out = {}
    if log.exists():
        for line in log.read_text().splitlines()[1:]:
            parts = line.split("\t")
            if len(parts) == 5 and f"{folder}/" in parts[3] and parts[3].endswith(".o"):
                out[parts[3]] = (int(parts[1]) - int(parts[0])) / 1e3
    return out


def main(path: str, seconds: float) -> None:
    import flashinfer
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    result: dict = {"flashinfer": flashinfer.__version__, "limit_s": seconds, "cpus": os.cpu_count()}
    spec = None
    for fast in (False, True):
        start = time.perf_counter()
        spec = gen_cutlass_fused_moe_sm90_module(use_fast_build=fast)
        spec.write_ninja()
        result[f"use_fast_build={fast}"] = {"generate_s": round(time.perf_counter() - start, 2),
                                            **build_file_facts(spec.ninja_path.read_text())}
    jobs = int(os.environ.get("MAX_JOBS") or (os.cpu_count() or 1) + 2)  # ninja's own default: CPUs + 2
    command = ["ninja", "-C", str(jit_env.FLASHINFER_JIT_DIR), "-f", str(spec.ninja_path), "-j", str(jobs)]
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=seconds)
        done = proc.returncode == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        done = False
    wall = time.perf_counter() - start
    per_object = finished(jit_env.FLASHINFER_JIT_DIR / ".ninja_log", spec.name)
    total = result["use_fast_build=True"]["objects"]
    mean = sum(per_object.values()) / max(1, len(per_object))
    serial = mean * total
    result["build"] = {
        "jobs": jobs, "wall_s": round(wall, 1), "finished": done, "objects_done": len(per_object),
        "objects_total": total, "object_s_mean": round(mean, 1),
        "object_s_max": round(max(per_object.values(), default=0.0), 1),
        "estimated_serial_s": round(serial), "estimated_wall_s": round(serial / jobs),
        "slowest": sorted(((round(s, 1), Path(t).name) for t, s in per_object.items()), reverse=True)[:8],
    }
    Path(path).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
