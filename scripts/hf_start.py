"""One ``piecegraph.hf.Session`` start, for issue 24's targets through ``piecegraph.hf``: a transformers Qwen2 of the
0.5B shape (random weights, ``scripts/hf_random_qwen2.py``), ``Session(max_seqs=64, max_len=640,
prefill_tokens=512)`` with every prefill and decode size captured at construction (``capture=True``) and the
artifact cache in CACHE_DIR, then one short greedy generate, whose tokens the cold and warm starts must agree on
(and which are compared with transformers' own greedy ``generate``, reported, not asserted: bf16 kernels differ).
Prints one JSON line: seconds per phase, each module's ``stats()["startup"]``, the pool's MiB and the tokens.

    python scripts/hf_start.py CACHE_DIR

PIECEGRAPH_START_SHARE_TRACE=0|1 (default 1: the decode module builds from the prefill module's trace),
PIECEGRAPH_START_FULL_COMPILE=auto|whole|pieces (default auto, the default: the decode graph compiled by pieces,
which it takes from the prefill module, where the whole graph is packaged in the background),
PIECEGRAPH_START_AOT=0|1 (``aot_package``; unset: packages on CUDA),
PIECEGRAPH_START_LAYERS=N (fewer layers). PIECEGRAPH_START_DEVICE=cpu makes a dry run (float32, graphs emulated).
"""

import time

T0 = time.perf_counter()


def main(cache_dir: str) -> None:
    import json
    import os
    import sys

    import torch

    t_torch = time.perf_counter()
    import piecegraph.hf as pghf

    t_pg = time.perf_counter()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_random_qwen2 import random_qwen2

    from piecegraph.cli_common import resolve_attention

    env = os.environ.get
    cuda = env("PIECEGRAPH_START_DEVICE", "cuda") == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = random_qwen2(int(env("PIECEGRAPH_START_LAYERS", "24")), device=device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t_model = time.perf_counter()
    backend = resolve_attention("auto", device)
    options = dict(share_trace=env("PIECEGRAPH_START_SHARE_TRACE", "1") != "0",
                   full_compile=env("PIECEGRAPH_START_FULL_COMPILE", "auto"),
                   aot_package={"0": False, "1": True}.get(env("PIECEGRAPH_START_AOT", "")))
    session = pghf.Session(model, max_seqs=64, max_len=640, prefill_tokens=512, backend=backend, capture=True,
                           cache_dir=cache_dir, emulate_graphs=not cuda, **options)
    sync()
    t_ready = time.perf_counter()
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    tokens = session.generate(prompts, 8)
    t_generate = time.perf_counter()
    with torch.no_grad():  # transformers' own greedy decoding of the same prompts, one at a time
        reference = [model.generate(torch.tensor([p], device=device), max_new_tokens=8, do_sample=False,
                                    min_new_tokens=8)[0, len(p):].tolist() for p in prompts]
    modules = {name: getattr(session, name).stats() for name in ("prefill", "decode")}
    print(json.dumps({
        "backend": backend, "model": "qwen2-0.5b-shape (transformers)", **options,
        "import_torch_s": t_torch - T0, "import_piecegraph_hf_s": t_pg - t_torch, "model_s": t_model - t_pg,
        "ready_s": t_ready - t_model, "from_interpreter_s": t_ready - T0, "generate_s": t_generate - t_ready,
        "modules": {name: {"sizes": len(s["capture_s"]), "startup": s["startup"]} for name, s in modules.items()},
        "pool_mib": modules["decode"]["pool_bytes"] / 2**20, "tokens": tokens,
        "tokens_equal_transformers": [a == b for a, b in zip(tokens, reference)],
    }, default=str))
    session.close()


if __name__ == "__main__":
    import sys

    main(sys.argv[1])
