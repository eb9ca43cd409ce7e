"""Which part of a cached start gives wrong hidden states on this machine? Each variant runs in a fresh process.

    python scripts/cache_diag.py OUT.json [--layers 4] [--only NAME,NAME]

A variant compiles the reference decoder (the 0.5B shape cut to ``--layers`` layers; bf16 and FlashInfer on a
GPU, float32 and torch attention on CPU) with ``piecegraph.compile`` in one mode, compiler and cache setting,
captures its sizes, then runs a prefill of three sequences (30, 57 and 100 tokens) and one decode step over
them, each against the eager model on a cache of its own fed the same steps. A full-graph variant prefills
eagerly and runs only the decode step through its graphs (as the engine's auto mode does). Cache folders are
shared by the variants that name the same one, so a "warm" variant loads what its "cold" one saved. Writes
each variant's relative error (max |out - ref| / max |ref|) per step and its ``stats()["startup"]``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

# name: (mode, compiler, cache folder tag or None, emulate_graphs)
VARIANTS = {
    "piecewise-nocache": ("piecewise", "inductor", None, False),
    "piecewise-cold": ("piecewise", "inductor", "pw", False),
    "piecewise-warm": ("piecewise", "inductor", "pw", False),
    "piecewise-cold-emulated": ("piecewise", "inductor", "pw-emulated", True),
    "piecewise-eagercompiler": ("piecewise", "eager", None, False),
    "full-nocache": ("full", "inductor", None, False),
    "full-cold": ("full", "inductor", "full", False),
    "full-warm": ("full", "inductor", "full", False),
}
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LENS = (30, 57, 100)


def _relative(out, ref) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def run_variant(name: str, folder: str | None, layers: int) -> dict:
    import torch

    import piecegraph
    from piecegraph.attention import AttentionMetadata, KVCache, flashinfer_available
    from piecegraph.models import QWEN2_5_0_5B, Decoder, dummy_inputs

    mode, compiler, _, emulate = VARIANTS[name]
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    backend = "torch" if flashinfer_available(torch.device(device)) else "flashinfer"
    shape = dataclasses.replace(QWEN2_5_0_5B, num_layers=layers)
    model = Decoder.random(shape, seed=0, dtype=dtype, device=device)
    caches = [KVCache.for_sequences(shape, len(LENS), 256, dtype=dtype, device=device, backend=backend)
              for _ in range(2)]
    module = piecegraph.compile(model, mode=mode, compiler=compiler, capture_sizes=SIZES, cache_dir=folder or False,
                                emulate_graphs=emulate or not cuda)
    module.capture(lambda n: dummy_inputs(model, caches[0], n))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, (sum(LENS),), generator=gen).to(device)
    step = torch.randint(1000, (len(LENS),), generator=gen).to(device)
    errors = {}
    with torch.no_grad():
        outs = []
        for cache, fn in zip(caches, (module if mode == "piecewise" else model, model)):
            meta = AttentionMetadata.for_batch(cache, [(i, 0, n) for i, n in enumerate(LENS)])
            with piecegraph.forward_context(meta):
                outs.append(fn(prompt, meta.positions).clone())
        errors["prefill"] = _relative(*outs)
        outs = []
        for cache, fn in zip(caches, (module, model)):
            meta = AttentionMetadata.for_decode(cache, [(i, n) for i, n in enumerate(LENS)])
            with piecegraph.forward_context(meta):
                outs.append(fn(step, meta.positions).clone())
        errors["decode"] = _relative(*outs)
    stats = module.stats()
    return {"variant": name, "device": device, "backend": backend, "errors": errors,
            "startup": {k: v for k, v in stats.get("startup", {}).items() if not isinstance(v, dict)},
            "pieces": stats.get("pieces")}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--variant":  # a child: one variant, its JSON on the last line
        print(json.dumps(run_variant(sys.argv[2], sys.argv[3] or None, int(sys.argv[4])), default=str))
        return
    out = sys.argv[1]
    layers = int(sys.argv[sys.argv.index("--layers") + 1]) if "--layers" in sys.argv else 4
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else list(VARIANTS)
    root = tempfile.mkdtemp(prefix="pg-cache-diag-")
    results = []
    for name, (_, _, tag, _) in VARIANTS.items():
        if name not in only:
            continue
        folder = os.path.join(root, tag) if tag else ""
        done = subprocess.run([sys.executable, __file__, "--variant", name, folder, str(layers)],
                              capture_output=True, text=True)
        try:
            result = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            result = {"variant": name, "failed": done.returncode, "stderr": done.stderr[-3000:]}
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "stderr"}, default=str), flush=True)
        if "stderr" in result:
            print(result["stderr"], file=sys.stderr)
    with open(out, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
