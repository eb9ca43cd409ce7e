"""Start-up time: one start in this process, or a series of starts, each in a fresh process.

    python scripts/startup.py modules|engine|hf CACHE_DIR [--profile OUT.prof]
    python scripts/startup.py series modules|engine|hf OUTDIR [--no-first] [--timeout 420]

A single start prints one JSON line (seconds per phase, each module's ``stats()["startup"]``, ...) and builds:

- ``modules``: the reference decoder, a prefill module (piecewise, every size up to 512 tokens) and a decode module
  (full graphs, batch 1..64) sharing one pool, every size captured, as a user's own process would; then one
  prefill call, whose output a cold and a warm start must agree on. Also torch's cache counters.
- ``engine``: the ``serve.Engine`` a server runs (mode auto, 64 sequences, 512 batched tokens), every size
  captured, then one short greedy generate whose tokens a cold and a warm start must agree on.
- ``hf``: a transformers Qwen2 of the 0.5B shape (``hf_random_qwen2.py``) in ``piecegraph.hf.Session(capture=True)``,
  then one short greedy generate, compared with transformers' own (reported, not asserted: bf16 kernels differ).

Environment of a single start: PIECEGRAPH_START_DEVICE=cpu and PIECEGRAPH_START_MODEL=tiny make a dry run
(float32, graphs emulated); PIECEGRAPH_START_LAYERS=N cuts the model to N layers; PIECEGRAPH_START_AOT=0|1 sets
``aot_package`` (unset: packages on CUDA); PIECEGRAPH_START_AOT_BACKGROUND=0 packages in the setup, not in a worker
after it; PIECEGRAPH_START_FULL_COMPILE=auto|whole|pieces (default whole for ``modules``, the library default auto
for the others); PIECEGRAPH_START_SHARE_TRACE=0|1 (``engine`` and ``hf``; default 1); PIECEGRAPH_START_WAIT_PACKAGING=1
(``modules``) waits for the background packaging after the measurements and times the decode call that swaps a
full graph compiled by pieces for its package. ``--profile``: cProfile's stats of the setup (model built to ready)
written there, the top functions printed to stderr.

``series`` runs, in fresh processes: ``first`` (its own cache folder, no packages, decode compiled by pieces:
FlashInfer's first JIT build is paid here, so the starts after it measure piecegraph's and torch's work; skipped
with ``--no-first`` when an earlier series of this machine built the kernels), ``cold`` (an empty cache folder),
the wait for its background packaging, then ``warm`` (the same folder). It writes one result file under OUTDIR
(``<date>_<gpu>_startup_<kind>.json``, one row per start) and each start's stderr and packaging logs beside it.
"""

import time

T0 = time.perf_counter()  # before any import a start pays for


def _env(name: str, default: str | None = None) -> str | None:
    import os

    return os.environ.get(f"PIECEGRAPH_START_{name}", default)


def _aot() -> bool | None:
    return {"0": False, "1": True}.get(_env("AOT", ""))


def _setup_profile(profile_out: str | None):
    if not profile_out:
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _dump_profile(profiler, profile_out: str | None) -> None:
    if profiler is None:
        return
    import pstats
    import sys

    profiler.disable()
    profiler.dump_stats(profile_out)
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(80)


def start_modules(cache_dir: str, profile_out: str | None = None) -> dict:
    import dataclasses
    import sys

    import torch

    t_torch = time.perf_counter()
    import piecegraph

    t_pg = time.perf_counter()
    from piecegraph.attention import AttentionMetadata, KVCache, flashinfer_available
    from piecegraph.models import QWEN2_5_0_5B, TINY, Decoder, dummy_inputs

    shape = TINY if _env("MODEL") == "tiny" else QWEN2_5_0_5B
    if _env("LAYERS"):
        shape = dataclasses.replace(shape, num_layers=int(_env("LAYERS")))
    cuda = _env("DEVICE", "cuda") == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    backend = "torch" if flashinfer_available(torch.device(device)) else "flashinfer"  # a reason when it cannot
    model = Decoder.random(shape, dtype=dtype, device=device)
    cache = KVCache.for_sequences(shape, 64, 640, dtype=dtype, device=device, backend=backend)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t_model = time.perf_counter()
    profiler = _setup_profile(profile_out)
    pool = piecegraph.GraphPool()
    common = dict(pool=pool, cache_dir=cache_dir, emulate_graphs=not cuda, aot_package=_aot(),
                  aot_background=_env("AOT_BACKGROUND", "1") != "0")
    prefill = piecegraph.compile(model, mode="piecewise", max_tokens=512, **common)
    decode = piecegraph.compile(model, mode="full", capture_sizes=(1, 2, 4, 8, 16, 32, 64),
                                full_compile=_env("FULL_COMPILE", "whole"), **common)
    for module in (prefill, decode):
        module.capture(lambda n: dummy_inputs(model, cache, n))
    sync()
    t_ready = time.perf_counter()
    _dump_profile(profiler, profile_out)
    # One real sequence's prefill, every token in its own slot: dummy inputs' pad rows all write the scratch page's
    # one slot, so what they read back depends on which write landed last, no value to compare across starts.
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
    if _env("WAIT_PACKAGING") == "1":
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
    return {
        "backend": backend, "model": _env("MODEL", "qwen2.5-0.5b"),
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
    }


def start_engine(cache_dir: str, profile_out: str | None = None) -> dict:
    import sys

    import torch

    t_torch = time.perf_counter()
    import piecegraph  # noqa: F401  (its import is timed on its own)

    t_pg = time.perf_counter()
    from piecegraph.cli_common import resolve_attention
    from piecegraph.models import QWEN2_5_0_5B, TINY, Decoder
    from piecegraph.serve import Engine, EngineConfig

    shape = TINY if _env("MODEL") == "tiny" else QWEN2_5_0_5B
    if _env("LAYERS"):
        shape = shape.replace(num_layers=int(_env("LAYERS")))
    cuda = _env("DEVICE", "cuda") == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    backend = resolve_attention("auto", device)
    model = Decoder.random(shape, dtype=dtype, device=device)
    if cuda:
        torch.cuda.synchronize()
    t_model = time.perf_counter()
    profiler = _setup_profile(profile_out)
    config = EngineConfig(
        mode="auto", max_num_seqs=64, max_num_batched_tokens=512, page_size=16, max_seq_len=640,
        num_pages=64 * 40 + 1, attention_backend=backend, emulate_graphs=not cuda, cache_dir=cache_dir,
        aot_package=_aot(), aot_background=_env("AOT_BACKGROUND", "1") != "0",
        full_compile=_env("FULL_COMPILE", "auto"), share_trace=_env("SHARE_TRACE", "1") != "0")
    engine = Engine(model, config)
    if cuda:
        torch.cuda.synchronize()
    t_ready = time.perf_counter()
    _dump_profile(profiler, profile_out)
    prompts = [[(7 * i + j) % shape.vocab_size for j in range(5 + 3 * i)] for i in range(4)]
    tokens = engine.generate(prompts)  # SamplingParams' default: greedy, a few tokens
    report = engine.capture_report()
    return {
        "backend": backend, "model": _env("MODEL", "qwen2.5-0.5b"),
        "full_compile": config.full_compile, "share_trace": config.share_trace,
        "import_torch_s": t_torch - T0, "import_piecegraph_s": t_pg - t_torch, "model_s": t_model - t_pg,
        "ready_s": t_ready - t_model, "from_interpreter_s": t_ready - T0,
        "modules": {kind: {k: m[k] for k in ("sizes", "setup_s", "capture_s", "startup")}
                    for kind, m in report["modules"].items()},
        "pool_mib": report["pool_mib"], "decode_choice": report.get("decode_choice"), "tokens": tokens,
        "compiler_imported": [m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules],
    }


def start_hf(cache_dir: str, profile_out: str | None = None) -> dict:
    import os
    import sys

    import torch

    t_torch = time.perf_counter()
    import piecegraph.hf as pghf

    t_pg = time.perf_counter()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_random_qwen2 import random_qwen2

    from piecegraph.cli_common import resolve_attention

    cuda = _env("DEVICE", "cuda") == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = random_qwen2(int(_env("LAYERS", "24")), device=device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t_model = time.perf_counter()
    profiler = _setup_profile(profile_out)
    backend = resolve_attention("auto", device)
    options = dict(share_trace=_env("SHARE_TRACE", "1") != "0", full_compile=_env("FULL_COMPILE", "auto"),
                   aot_package=_aot())
    session = pghf.Session(model, max_seqs=64, max_len=640, prefill_tokens=512, backend=backend, capture=True,
                           cache_dir=cache_dir, emulate_graphs=not cuda, **options)
    sync()
    t_ready = time.perf_counter()
    _dump_profile(profiler, profile_out)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    tokens = session.generate(prompts, 8)
    t_generate = time.perf_counter()
    with torch.no_grad():  # transformers' own greedy decoding of the same prompts, one at a time
        reference = [model.generate(torch.tensor([p], device=device), max_new_tokens=8, do_sample=False,
                                    min_new_tokens=8)[0, len(p):].tolist() for p in prompts]
    modules = {name: getattr(session, name).stats() for name in ("prefill", "decode")}
    session.close()
    return {
        "backend": backend, "model": "qwen2-0.5b-shape (transformers)", **options,
        "import_torch_s": t_torch - T0, "import_piecegraph_hf_s": t_pg - t_torch, "model_s": t_model - t_pg,
        "ready_s": t_ready - t_model, "from_interpreter_s": t_ready - T0, "generate_s": t_generate - t_ready,
        "modules": {name: {"sizes": len(s["capture_s"]), "startup": s["startup"]} for name, s in modules.items()},
        "pool_mib": modules["decode"]["pool_bytes"] / 2**20, "tokens": tokens,
        "tokens_equal_transformers": [a == b for a, b in zip(tokens, reference)],
    }


STARTS = {"modules": start_modules, "engine": start_engine, "hf": start_hf}


def series(kind: str, outdir: str, first: bool = True, timeout: float = 420.0) -> int:
    """The starts of the module docstring, each in a fresh process; one result file. Returns 0 when every start
    gave its JSON line."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from piecegraph.cache import wait_packaging
    from piecegraph.results.schema import environment, result_name, write_result

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    base = dict(os.environ)
    # FlashInfer's JIT workspace stays outside the cache folders (else each fresh folder builds the kernels again).
    base.setdefault("FLASHINFER_WORKSPACE_BASE", str(Path.home()))
    no_packages = {"PIECEGRAPH_START_AOT": "0", "PIECEGRAPH_START_FULL_COMPILE": "pieces"}
    cold_env = {"PIECEGRAPH_START_WAIT_PACKAGING": "1"} if kind == "modules" else {}
    steps = ([("first", "first", no_packages)] if first else []) + [("cold", "main", cold_env), ("warm", "main", {})]
    rows, status = [], 0
    with tempfile.TemporaryDirectory(prefix="pg-startup-") as scratch:
        for name, folder, extra in steps:
            cache = Path(scratch) / folder
            began = time.perf_counter()
            try:
                done = subprocess.run([sys.executable, os.path.abspath(__file__), kind, str(cache)],
                                      capture_output=True, text=True, timeout=timeout, env={**base, **extra})
                rc, stdout, stderr = done.returncode, done.stdout, done.stderr
            except subprocess.TimeoutExpired as err:
                rc, stdout, stderr = "timeout", err.stdout or "", err.stderr or ""
                stdout, stderr = (s.decode(errors="replace") if isinstance(s, bytes) else s for s in (stdout, stderr))
            (out / f"startup_{kind}_{name}.err").write_text(stderr)
            lines = stdout.strip().splitlines()
            try:
                row = {"start": name, **json.loads(lines[-1])}
            except (IndexError, ValueError):
                row, status = {"start": name, "failed": f"rc={rc}: {stderr.strip()[-400:]}"}, 1
            row["wall_s"] = time.perf_counter() - began
            if name == "cold" and kind != "modules":  # the worker packages after the start is ready
                try:
                    row["packaging"] = wait_packaging(cache, timeout=300)
                except TimeoutError as err:
                    row["packaging"] = {"timeout": str(err)}
            logs = sorted((cache / "packaging").glob("*.log")) if cache.exists() else []
            if logs:
                (out / f"startup_{kind}_{name}_packaging.log").write_text(
                    "".join(f"== {p.name}\n{p.read_text(errors='replace')}" for p in logs))
            rows.append(row)
            print(f"startup {kind} {name}: rc={rc} ready_s={row.get('ready_s')}", flush=True)
            if folder == "first":
                shutil.rmtree(cache, ignore_errors=True)
    ok = next((r for r in rows if "failed" not in r), {})
    cuda = base.get("PIECEGRAPH_START_DEVICE", "cuda") == "cuda"
    env = environment(attention=ok.get("backend"), model=ok.get("model", "qwen2.5-0.5b"),
                      dtype="bfloat16" if cuda else "float32", quant=None, kind=kind, first_start=first)
    path = out / result_name(env, f"startup_{kind}")
    write_result(path, f"startup_{kind}", env, rows)
    print(f"wrote {path}")
    return status


def main() -> None:
    import argparse
    import json
    import sys

    parser = argparse.ArgumentParser(description="Start-up time: one start, or a series in fresh processes.",
                                     epilog="Options of a single start are environment variables: see the "
                                            "module docstring (PIECEGRAPH_START_*).")
    sub = parser.add_subparsers(dest="what", required=True)
    for kind in STARTS:
        one = sub.add_parser(kind, help=f"one {kind} start in this process; prints one JSON line")
        one.add_argument("cache_dir")
        one.add_argument("--profile", metavar="OUT.prof", help="cProfile the setup, write the stats there")
    many = sub.add_parser("series", help="first, cold and warm starts in fresh processes; one result file")
    many.add_argument("kind", choices=sorted(STARTS))
    many.add_argument("outdir")
    many.add_argument("--no-first", action="store_true", help="skip the first start (FlashInfer's JIT build)")
    many.add_argument("--timeout", type=float, default=420.0, help="seconds per start (default 420)")
    args = parser.parse_args()
    if args.what == "series":
        sys.exit(series(args.kind, args.outdir, first=not args.no_first, timeout=args.timeout))
    print(json.dumps(STARTS[args.what](args.cache_dir, args.profile), default=str))


if __name__ == "__main__":
    main()
