"""Does a running ``piecegraph serve`` give the engine's tokens, and how fast is one request alone on each side?

    python scripts/http_token_check.py URL MODEL --json OUT [--prompts 16] [--new 64] [--reference FILE]
        [engine options as serve's]

Sends ``--prompts`` seeded token-id prompts greedily (``ignore_eos``, ``return_token_ids``) to URL, 8 at a time;
then builds the same preset in this process with the same engine settings (artifact cache off) and generates the
same prompts with ``Engine.generate``. Writes whether every request's tokens are equal (bf16 near-ties are named,
not hidden: the first differing position and its two tokens, which scripts/judge_divergences.py judges
afterwards on any machine), and one request alone, timed on both sides: the
server's per-token time from streamed events, the engine's from ``generate`` of one prompt (wall time / tokens).
``--reference FILE``: the engine's side is read from FILE when it exists, else computed and written there, so
checks of several servers (or of one server before and after a load) build the in-process engine once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.request import Request, urlopen


def _post(url: str, body: dict) -> list[int]:
    request = Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"})
    with urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def _stream_times(url: str, body: dict) -> list[float]:
    request = Request(f"{url}/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                      headers={"Content-Type": "application/json"})
    times = []
    with urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: {") and b'"token_ids"' in line:
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                times += [time.perf_counter()] * len(ids)
    return times


def _read_reference(path: str | None, prompts: list[list[int]], new: int) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    if saved["prompts"] != prompts or saved["new"] != new:
        raise SystemExit(f"--reference {path} holds other prompts or lengths; remove it")
    return saved


def _engine_reference(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    import torch

    from piecegraph.cli_common import load_model
    from piecegraph.serve import Engine, EngineConfig, SamplingParams

    gpu = args.device == "cuda"
    net = load_model(args.model, args.device, torch.bfloat16 if gpu else torch.float32)
    engine = Engine(net, EngineConfig(mode=args.mode, max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_batched_tokens,
                                      max_seq_len=args.max_seq_len, attention_backend="flashinfer" if gpu else "torch",
                                      compiler="inductor" if gpu else "eager", emulate_graphs=not gpu,
                                      cache_dir=False))
    params = SamplingParams(max_new_tokens=args.new)  # no EOS: as the server's ignore_eos
    local = engine.generate(prompts, params)
    engine_ms = []
    for _ in range(3):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate([prompts[0]], params)[0]
        engine_ms.append(1e3 * (time.perf_counter() - start) / len(out))
    return {"tokens": local, "engine_ms": engine_ms}


def _divergence(i: int, served: list[int], engine: list[int]) -> dict:
    """Where request ``i``'s tokens first differ, the two tokens there and a window around it (from ``from``), for
    scripts/judge_divergences.py to judge."""
    at = next((j for j, (a, b) in enumerate(zip(served, engine)) if a != b), min(len(served), len(engine)))
    start = max(0, at - 2)
    row = {"request": i, "position": at, "from": start, "served": served[start:at + 6],
           "engine": engine[start:at + 6], "served_len": len(served), "engine_len": len(engine)}
    if at < min(len(served), len(engine)):
        row["served_token"], row["engine_token"] = served[at], engine[at]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("model")
    parser.add_argument("--json", required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-seq-len", type=int, default=832)
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--device", default="cuda", help="cuda (bf16, FlashInfer, Inductor) | cpu (a dry run)")
    parser.add_argument("--reference", help="the engine's tokens and times: read when the file exists, else written")
    args = parser.parse_args()
    url = args.url.rstrip("/")
    with urlopen(f"{url}/v1/models", timeout=30) as response:
        served_model = json.loads(response.read())["data"][0]
    vocab, longest = served_model["vocab_size"], min(300, served_model["max_model_len"] - args.new)
    rng = random.Random(0)
    prompts = [[rng.randrange(min(vocab, 1000)) for _ in range(rng.randint(min(16, longest), longest))]
               for _ in range(args.prompts)]
    body = {"model": args.model, "max_tokens": args.new, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(lambda p: _post(url, {**body, "prompt": p}), prompts))
    alone = [_stream_times(url, {**body, "prompt": prompts[0]}) for _ in range(3)]
    server_ms = [1e3 * (t[-1] - t[0]) / (len(t) - 1) for t in alone]

    reference = _read_reference(args.reference, prompts, args.new)
    if reference is None:
        reference = _engine_reference(args, prompts)
        if args.reference:
            with open(args.reference, "w") as f:
                json.dump({"prompts": prompts, "new": args.new, **reference}, f)
    local, engine_ms = reference["tokens"], reference["engine_ms"]
    differ = [_divergence(i, s, w) for i, (s, w) in enumerate(zip(served, local)) if s != w]
    result = {"url": url, "model": args.model, "prompts": len(prompts), "new_tokens": args.new,
              "equal": len(prompts) - len(differ), "differ": differ,
              "server_ms_per_token_alone": server_ms, "engine_generate_ms_per_token_alone": engine_ms,
              "note": "engine_generate includes its prefill in the per-token time"}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "differ"}), f"{len(differ)} differ")


if __name__ == "__main__":
    main()
