"""Issue 24's way to a warm start without the compiler stack: can a compiled piece, packaged by AOTInductor with a
symbolic token count, be loaded and run in a fresh process that imports neither Dynamo nor Inductor (nor sympy)?

A warm start today imports ``torch._dynamo`` and ``torch._inductor`` (3.3 + 2.7 s on the H200, stop 42) before it
loads a piece from Inductor's FX cache (~1 s a piece there). This probe exports a decoder-like block (norm, the
projections, SiLU gating, residual) with the token dimension dynamic, packages it (``aoti_compile_and_package``,
timed: what a cold start would add per distinct piece), then in a fresh process loads it through torch's C++
package loader (``torch._C._aoti.AOTIModelPackageLoader``, a private API: ``torch._inductor.aoti_load_package``
is the public one, and imports Inductor), runs it at several token counts against eager (on CUDA also replayed
from a CUDA graph captured around it), and lists which of the compiler stack's modules the process imported.
Then the same for piecegraph's own pieces of the tiny decoder (:func:`pieces`). Prints one JSON line. (What this
probe found is what ``Config(aot_package=...)`` does now: trace/aot_package.py, trace/aot_load.py.)

    python scripts/aoti_warm_probe.py OUT_DIR [cpu|cuda]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

LOAD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
folder, device = sys.argv[1], sys.argv[2]
index = torch.cuda.current_device() if device == "cuda" else -1
loader = torch._C._aoti.AOTIModelPackageLoader(folder + "/block.pt2", "model", False, 1, index)
t2 = time.perf_counter()
cases = torch.load(folder + "/cases.pt")
worst = max(float((loader.run([x])[0] - want).abs().max() / want.abs().max()) for x, want in cases)
t3 = time.perf_counter()
graph = None
if device == "cuda":  # replayed from a CUDA graph, as piecegraph would: new inputs copied into the captured ones
    try:
        x, want = cases[2]
        static = torch.zeros_like(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            loader.run([static])
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            out = loader.run([static])[0]
        static.copy_(x)
        g.replay()
        torch.cuda.synchronize()
        graph = float((out - want).abs().max() / want.abs().max())
    except Exception as err:
        graph = f"{type(err).__name__}: {err}"[:300]
print(json.dumps({"import_torch_s": t1 - t0, "load_s": t2 - t1, "run_all_s": t3 - t2, "worst_rel_err": worst,
                  "tokens": [int(x.shape[0]) for x, _ in cases], "graph_replay_rel_err": graph,
                  "imported": {m: m in sys.modules for m in ("torch._dynamo", "torch._inductor", "sympy")}}))
"""


def build(folder: Path, device: str) -> float:
    """Export and package the block; save inputs and eager outputs at several token counts. Returns seconds."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self, hidden: int = 256, width: int = 704):
            super().__init__()
            self.norm = torch.nn.RMSNorm(hidden)
            self.up = torch.nn.Linear(hidden, 2 * width)
            self.down = torch.nn.Linear(width, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate, up = self.up(self.norm(x)).chunk(2, dim=-1)
            return x + self.down(torch.nn.functional.silu(gate) * up)

    torch.manual_seed(0)
    block = Block().to(device).eval()
    tokens = torch.export.Dim("tokens", min=1, max=4096)
    with torch.no_grad():
        program = torch.export.export(block, (torch.randn(8, 256, device=device),), dynamic_shapes={"x": {0: tokens}})
        start = time.perf_counter()
        torch._inductor.aoti_compile_and_package(program, package_path=str(folder / "block.pt2"))
        seconds = time.perf_counter() - start
        cases = [(x, block(x)) for x in (torch.randn(n, 256, device=device) for n in (1, 7, 300, 2048))]
    torch.save(cases, folder / "cases.pt")
    return seconds


def pieces(folder: Path, device: str) -> list[dict]:
    """piecegraph's own pieces of the tiny decoder (as compiled, before Inductor rewrites them), each exported with
    its token count dynamic and packaged, then run through the loader at the traced token count against the piece
    run eagerly. One change first: a piece takes the token count as an int input too (Dynamo's SymInt), which
    export cannot keep symbolic, so each such input becomes ``sym_size`` of a tensor input with the same symbol.
    Outputs the piece makes with ``empty_like`` (the attention op's output buffer, written by the split op) are not
    compared."""
    import copy

    import torch

    import piecegraph
    import piecegraph.trace.backend as backend
    from piecegraph.attention import KVCache
    from piecegraph.models import TINY, Decoder, dummy_inputs
    from piecegraph.trace.aot_job import describe_unit, example_tensor, export_dims

    seen, compile_piece = [], backend._compile_piece

    def keep(sub, args, compiler, *rest, **how):
        seen.append((copy.deepcopy(sub), list(args)))
        return compile_piece(sub, args, compiler, *rest, **how)

    backend._compile_piece = keep
    try:
        model = Decoder.random(TINY, device=device).eval()
        cache = KVCache.for_sequences(TINY, 4, 64, dtype=torch.float32, device=device, backend="torch")
        graphed = piecegraph.compile(model, mode="piecewise", max_tokens=16, emulate_graphs=device == "cpu")
        graphed.capture(lambda n: dummy_inputs(model, cache, n), [16])
    finally:
        backend._compile_piece = compile_piece
    out = []
    for i, (sub, fakes) in enumerate(seen):
        job = describe_unit(sub, fakes, False, f"piece{i}.pt2")
        sub, args = job.graph, [example_tensor(spec) for spec in job.inputs]
        dynamic = export_dims(job.inputs)
        start = time.perf_counter()
        program = torch.export.export(sub, tuple(args), dynamic_shapes=(dynamic,), strict=False)
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / f"piece{i}.pt2"))
        seconds = time.perf_counter() - start
        got = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, job.spec.device_index).run(args)
        ran = sub(*args)
        want = [w for w in (ran if isinstance(ran, (tuple, list)) else [ran]) if isinstance(w, torch.Tensor)]
        buffers = job.skip
        errors = [float((g - w).abs().max() / w.abs().max().clamp_min(1e-30)) for j, (g, w) in
                  enumerate(zip(got, want)) if j not in buffers]
        out.append({"piece": i, "inputs": len(args), "outputs": len(want), "export_and_package_s": seconds,
                    "worst_rel_err": max(errors, default=0.0), "uncompared_buffers": sorted(buffers)})
    return out


def main(out: str, device: str = "cpu") -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    package_s = build(folder, device)
    loaded = subprocess.run([sys.executable, "-c", LOAD, str(folder), device], capture_output=True, text=True,
                            check=True)
    result = {"device": device, "package_s": package_s, **json.loads(loaded.stdout.strip().splitlines()[-1]),
              "pieces": pieces(folder, device)}
    (folder / "aoti_warm_probe.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:3])
