"""One engine start, as a server makes it: issue 24's cold and warm targets are for "the same engine", every capture
size captured. Imports, the 0.5B shape's reference decoder, then ``serve.Engine`` in mode auto (a piecewise module for
prefill and mixed steps up to 512 tokens, a full module for decode batches up to 64, one pool, auto's decode choice
timed), then one short greedy generate whose tokens the cold and warm starts must agree on. Prints one JSON line:
seconds per phase, each module's ``stats()["startup"]``, the pool's MiB and the tokens.

    python scripts/engine_start.py CACHE_DIR

Unlike ``scripts/start_once.py`` (two modules set up one after the other, each tracing the model), this is the
engine a server runs, with the engine's own options: PIECEGRAPH_START_FULL_COMPILE=auto|whole|pieces (default
auto, ``EngineConfig.full_compile``'s default: by pieces here, where the whole graph is packaged in the
background), PIECEGRAPH_START_SHARE_TRACE=0|1 (default 1: the full module builds from the piecewise module's trace,
``EngineConfig.share_trace``), PIECEGRAPH_START_AOT=0|1 (``aot_package``; unset: packages on CUDA),
PIECEGRAPH_START_AOT_BACKGROUND=0 (package in the setup). PIECEGRAPH_START_MODEL=tiny and PIECEGRAPH_START_DEVICE=cpu
make a dry run (graphs emulated).
"""

import time

T0 = time.perf_counter()


def main(cache_dir: str) -> None:
    import json
    import os

    import torch

    t_torch = time.perf_counter()
    import piecegraph  # noqa: F401  (its import is timed on its own, as start_once.py does)

    t_pg = time.perf_counter()
    from piecegraph.cli_common import resolve_attention
    from piecegraph.models import QWEN2_5_0_5B, TINY, Decoder
    from piecegraph.serve import Engine, EngineConfig

    env = os.environ.get
    shape = TINY if env("PIECEGRAPH_START_MODEL") == "tiny" else QWEN2_5_0_5B
    cuda = env("PIECEGRAPH_START_DEVICE", "cuda") == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    backend = resolve_attention("auto", device)
    model = Decoder.random(shape, dtype=dtype, device=device)
    if cuda:
        torch.cuda.synchronize()
    t_model = time.perf_counter()
    config = EngineConfig(
        mode="auto", max_num_seqs=64, max_num_batched_tokens=512, page_size=16, max_seq_len=640,
        num_pages=64 * 40 + 1, attention_backend=backend, emulate_graphs=not cuda, cache_dir=cache_dir,
        aot_package={"0": False, "1": True}.get(env("PIECEGRAPH_START_AOT", "")),
        aot_background=env("PIECEGRAPH_START_AOT_BACKGROUND", "1") != "0",
        full_compile=env("PIECEGRAPH_START_FULL_COMPILE", "auto"),
        share_trace=env("PIECEGRAPH_START_SHARE_TRACE", "1") != "0")
    engine = Engine(model, config)
    if cuda:
        torch.cuda.synchronize()
    t_ready = time.perf_counter()
    prompts = [[(7 * i + j) % shape.vocab_size for j in range(5 + 3 * i)] for i in range(4)]
    tokens = engine.generate(prompts)  # SamplingParams' default: greedy, a few tokens
    report = engine.capture_report()
    print(json.dumps({
        "backend": backend, "model": env("PIECEGRAPH_START_MODEL", "qwen2.5-0.5b"),
        "full_compile": config.full_compile, "share_trace": config.share_trace,
        "import_torch_s": t_torch - T0, "import_piecegraph_s": t_pg - t_torch, "model_s": t_model - t_pg,
        "ready_s": t_ready - t_model, "from_interpreter_s": t_ready - T0,
        "modules": {kind: {k: m[k] for k in ("sizes", "setup_s", "capture_s", "startup")}
                    for kind, m in report["modules"].items()},
        "pool_mib": report["pool_mib"], "decode_choice": report.get("decode_choice"), "tokens": tokens,
    }, default=str))


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
