"""One start, as a user's process makes it (issue 24's startup test runs it in fresh processes): imports, the
reference decoder, a prefill module (piecewise, every size up to 512 tokens) and a decode module (full graphs,
batch 1..64) sharing one pool, every size captured; then one prefill call, whose output the cold and warm starts
must agree on. Prints one JSON line: seconds per phase, each module's stats()["startup"], capture ms, graph memory,
and torch's cache counters (AOTAutograd's and Inductor's FX graph cache hits and misses).

    python scripts/start_once.py CACHE_DIR [PROFILE_OUT]

PIECEGRAPH_START_MODEL=tiny and PIECEGRAPH_START_DEVICE=cpu make a dry run; PIECEGRAPH_START_LAYERS=N cuts the
model to N layers; PIECEGRAPH_START_AOT=0 / 1 sets Config.aot_package to False / True (unset: None, packages on
CUDA); PIECEGRAPH_START_AOT_BACKGROUND=0 packages in the setup, not in a worker after it (Config.aot_background);
PIECEGRAPH_START_WAIT_PACKAGING=1 waits, after the JSON's measurements, for the background worker and adds its
state and seconds ("packaging"), and times the decode call that swaps a full graph compiled by pieces for the
worker's package ("swap"); PIECEGRAPH_START_FULL_COMPILE=pieces compiles the decode module by pieces
(Config.full_compile).
PROFILE_OUT: cProfile's stats of the setup (model built to ready) written there, and its top functions by cumulative
time printed to stderr.
"""

import time

T0 = time.perf_counter()


def main(cache_dir: str, profile_out: str | None = None) -> None:
    import json
    import os
    import sys

    import torch

    t_torch = time.perf_counter()
    import piecegraph

    t_pg = time.perf_counter()
    from piecegraph.attention import AttentionMetadata, KVCache, flashinfer_available
    from piecegraph.models import QWEN2_5_0_5B, TINY, Decoder, dummy_inputs

    shape = TINY if os.environ.get("PIECEGRAPH_START_MODEL") == "tiny" else QWEN2_5_0_5B
    if os.environ.get("PIECEGRAPH_START_LAYERS"):
        import dataclasses

        shape = dataclasses.replace(shape, num_layers=int(os.environ["PIECEGRAPH_START_LAYERS"]))
    cuda = os.environ.get("PIECEGRAPH_START_DEVICE", "cuda") == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    backend = "torch" if flashinfer_available(torch.device(device)) else "flashinfer"
    model = Decoder.random(shape, dtype=dtype, device=device)
    cache = KVCache.for_sequences(shape, 64, 640, dtype=dtype, device=device, backend=backend)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t_model = time.perf_counter()
    profiler = None
    if profile_out:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    pool = piecegraph.GraphPool()
    aot = {"0": False, "1": True}.get(os.environ.get("PIECEGRAPH_START_AOT", ""))
    background = os.environ.get("PIECEGRAPH_START_AOT_BACKGROUND", "1") != "0"
    common = dict(pool=pool, cache_dir=cache_dir, emulate_graphs=not cuda, aot_package=aot, aot_background=background)
    prefill = piecegraph.compile(model, mode="piecewise", max_tokens=512, **common)
    full_compile = os.environ.get("PIECEGRAPH_START_FULL_COMPILE", "whole")
    decode = piecegraph.compile(model, mode="full", capture_sizes=(1, 2, 4, 8, 16, 32, 64), full_compile=full_compile,
                                **common)
    for module in (prefill, decode):
        module.capture(lambda n: dummy_inputs(model, cache, n))
    sync()
    t_ready = time.perf_counter()
    if profiler is not None:
        import pstats

        profiler.disable()
        profiler.dump_stats(profile_out)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(80)
    # one real sequence's prefill: every token its own slot (pad rows of dummy_inputs all write the scratch page's
    # one slot, so what they read back depends on which write landed last: no value to compare across starts)
    meta = AttentionMetadata.for_batch(cache, [(0, 0, 37)])
    ids = torch.arange(37, device=device) % shape.vocab_size
    with piecegraph.forward_context(meta):
        out = prefill(ids, meta.positions).float()
    stats = {name: m.stats() for name, m in (("prefill", prefill), ("decode", decode))}
    torch_caches = {}
    if "torch._dynamo" in sys.modules:  # a start from packages imports no Dynamo: nothing to count
        from torch._dynamo.utils import counters

        torch_caches = {k: v for group in ("aot_autograd", "inductor") for k, v in counters[group].items()
                        if "cache" in k}
    packaging, waited = {}, time.perf_counter()
    if os.environ.get("PIECEGRAPH_START_WAIT_PACKAGING") == "1":
        from piecegraph.cache import wait_packaging

        packaging = wait_packaging(cache_dir, timeout=900)
    swap = None
    if packaging and getattr(decode, "_upgrade", None) is not None:  # compiled by pieces: the package swaps in
        decode._upgrade.next_check = 0.0  # at this call (a server's next decode step), not up to 1 s later
        args, meta = dummy_inputs(model, cache, 1)
        began = time.perf_counter()
        with piecegraph.forward_context(meta):
            decode(*args)
        sync()
        swap = {"call_s": time.perf_counter() - began, "aot": decode.stats()["startup"].get("aot")}
    print(json.dumps({
        "backend": backend, "model": os.environ.get("PIECEGRAPH_START_MODEL", "qwen2.5-0.5b"),
        "import_torch_s": t_torch - T0, "import_piecegraph_s": t_pg - t_torch, "model_s": t_model - t_pg,
        "ready_s": t_ready - t_model, "from_interpreter_s": t_ready - T0,
        "startup": {k: s["startup"] for k, s in stats.items()},
        "capture_ms": {k: {n: round(v * 1e3, 2) for n, v in s["capture_s"].items()} for k, s in stats.items()},
        "graph_memory": {k: s["graph_memory"] for k, s in stats.items()},
        "pool_bytes": stats["prefill"]["pool_bytes"], "torch_caches": torch_caches,
        "out_sum": out.sum().item(), "out_head": out[:2, :8].tolist(),
        "compiler_imported": [m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules],
        "packaging": packaging, "packaging_wait_s": time.perf_counter() - waited if packaging else None,
        "swap": swap,
    }, default=str))


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:3])
