"""The graph a cold cached start compiles, beside the one Dynamo traced: what the snapshot kept and lost.

    python scripts/snapshot_dump.py OUTDIR

Compiles the reference decoder (0.5B shape, 2 layers) piecewise with a fresh cache folder, for each attention
backend and dtype this machine runs, and writes Dynamo's graph and the restored one (their code, and each
node's op and target) under OUTDIR, with the split's pieces; prints per case the targets whose counts differ.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

import piecegraph
import piecegraph.build as build
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.models import QWEN2_5_0_5B, Decoder, dummy_inputs


def _nodes(gm: torch.fx.GraphModule) -> list[list[str]]:
    return [[n.op, str(n.target), type(n.target).__name__] for n in gm.graph.nodes]


def dump(out: Path, backend: str, dtype: torch.dtype, device: str) -> dict:
    seen = {}
    original = build._through_snapshot

    def spy(gm, example_inputs, snapshots):
        seen["dynamo"] = (gm.code, _nodes(gm))
        restored, inputs = original(gm, example_inputs, snapshots)
        seen["restored"] = (restored.code, _nodes(restored))
        return restored, inputs

    build._through_snapshot = spy
    try:
        shape = dataclasses.replace(QWEN2_5_0_5B, num_layers=2)
        model = Decoder.random(shape, seed=0, dtype=dtype, device=device)
        cache = KVCache.for_sequences(shape, 2, 128, dtype=dtype, device=device, backend=backend)
        module = piecegraph.compile(model, mode="piecewise", capture_sizes=(16, 32), cache_dir=tempfile.mkdtemp(),
                                    emulate_graphs=device == "cpu")
        module.capture(lambda n: dummy_inputs(model, cache, n))
        meta = AttentionMetadata.for_batch(cache, [(0, 0, 20)])
        ids = torch.arange(20, device=device)
        with piecegraph.forward_context(meta), torch.no_grad():
            got = module(ids, meta.positions).float()
        ref_cache = KVCache.for_sequences(shape, 2, 128, dtype=dtype, device=device, backend=backend)
        meta = AttentionMetadata.for_batch(ref_cache, [(0, 0, 20)])
        with piecegraph.forward_context(meta), torch.no_grad():
            want = model(ids, meta.positions).float()
    finally:
        build._through_snapshot = original
    name = f"{backend}_{str(dtype).removeprefix('torch.')}"
    result = {"case": name, "pieces": module.stats().get("pieces"),
              "error": float((got - want).abs().max() / want.abs().max())}
    counts = {}
    for which, (code, nodes) in seen.items():
        (out / f"{name}_{which}.py").write_text(code)
        (out / f"{name}_{which}_nodes.json").write_text(json.dumps(nodes, indent=0))
        counts[which] = collections.Counter(f"{op} {target}" for op, target, _ in nodes)
    if len(counts) == 2:
        keys = set(counts["dynamo"]) | set(counts["restored"])
        result["count_differs"] = {k: [counts["dynamo"][k], counts["restored"][k]] for k in sorted(keys)
                                   if counts["dynamo"][k] != counts["restored"][k]}
        result["nodes"] = [sum(counts["dynamo"].values()), sum(counts["restored"].values())]
    return result


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cases = [("flashinfer", torch.bfloat16), ("torch", torch.bfloat16), ("torch", torch.float32)] if cuda else \
        [("torch", torch.bfloat16), ("torch", torch.float32)]
    for backend, dtype in cases:
        try:
            result = dump(out, backend, dtype, device)
        except Exception as err:  # noqa: BLE001  (report every case)
            result = {"case": f"{backend}_{dtype}", "failed": f"{type(err).__name__}: {err}"}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
