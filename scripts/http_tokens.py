"""Does a running ``piecegraph serve`` give the engine's tokens? Check on the GPU machine, judge anywhere afterwards.

    python scripts/http_tokens.py check URL MODEL OUTDIR [--prompts 16] [--new 64] [--reference FILE] [--tag TAG]
        [engine options as serve's]
    python scripts/http_tokens.py judge REFERENCE.json CHECK.json [CHECK.json ...] [--out OUTDIR]

``check`` sends ``--prompts`` seeded token-id prompts greedily (``ignore_eos``, ``return_token_ids``) to URL, 8 at
a time; then builds the same preset in this process with the same engine settings (artifact cache off) and
generates the same prompts with ``Engine.generate``. Writes ``<date>_<gpu>_http_tokens[_TAG].json`` under OUTDIR:
one row per request, equal or not (bf16 near-ties are named, not hidden: the first differing position and the two
tokens there), and one request alone timed on both sides: the server's per-token time from streamed events, the
engine's from ``generate`` of one prompt (wall time / tokens, its prefill included). ``--reference FILE``: the
engine's side is read from FILE when it exists, else computed and written there, so checks of several servers
(or of one server before and after a load) build the in-process engine once.

``judge`` says whether a check's divergences are bf16 near-ties, on any machine (CPU is fine). REFERENCE.json is
the check's ``--reference`` file (the prompts and the in-process engine's tokens). The preset (random, seed 0: the
same weights on every device) is rebuilt in bfloat16 and run in float32 with the torch attention backend, a
reference more precise than either side. At each first divergence it reports how many bf16 steps separate the
engine's token from the reference's runner-up (and from the server's token): a gap of about one step or less
means kernels equal up to rounding may pick either token, so a batch of another composition (the server's) can
flip it. Prints one line per divergence; ``--out`` also writes ``<date>_cpu_http_tokens_judge.json`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.request import Request, urlopen

from piecegraph.results.schema import environment, load_result, result_name, write_result


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


def read_reference(path: str | Path) -> dict:
    """A ``--reference`` file as ``{"prompts", "tokens", "new", "engine_ms"}``."""
    result = load_result(path)
    return {"prompts": [r["prompt"] for r in result.rows], "tokens": [r["tokens"] for r in result.rows],
            "new": result.extra.get("new"), "engine_ms": result.extra.get("engine_ms"), "env": result.env}


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
    return {"prompts": prompts, "tokens": local, "new": args.new, "engine_ms": engine_ms}


def _divergence(served: list[int], engine: list[int]) -> dict:
    """Where a request's tokens first differ, the two tokens there and a window around it (from ``from``)."""
    at = next((j for j, (a, b) in enumerate(zip(served, engine)) if a != b), min(len(served), len(engine)))
    start = max(0, at - 2)
    row = {"position": at, "from": start, "served": served[start:at + 6], "engine": engine[start:at + 6],
           "served_len": len(served), "engine_len": len(engine)}
    if at < min(len(served), len(engine)):
        row["served_token"], row["engine_token"] = served[at], engine[at]
    return row


def check(args: argparse.Namespace) -> None:
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

    env = environment(attention="flashinfer" if args.device == "cuda" else "torch", model=args.model,
                      dtype="bfloat16" if args.device == "cuda" else "float32", quant=None, mode=args.mode)
    reference = None
    if args.reference and os.path.exists(args.reference):
        reference = read_reference(args.reference)
        if reference["prompts"] != prompts or reference["new"] != args.new:
            raise SystemExit(f"--reference {args.reference} holds other prompts or lengths; remove it")
    if reference is None:
        reference = _engine_reference(args, prompts)
        if args.reference:
            write_result(args.reference, "http_tokens_reference", env,
                         [{"prompt": p, "tokens": t} for p, t in zip(prompts, reference["tokens"])],
                         new=args.new, engine_ms=reference["engine_ms"])
    rows = []
    for i, (s, w) in enumerate(zip(served, reference["tokens"])):
        rows.append({"request": i, "equal": True} if s == w else {"request": i, "equal": False, **_divergence(s, w)})
    equal = sum(r["equal"] for r in rows)
    summary = {"url": url, "prompts": len(prompts), "new_tokens": args.new, "equal": equal,
               "server_ms_per_token_alone": server_ms, "engine_generate_ms_per_token_alone": reference["engine_ms"],
               "note": "engine_generate includes its prefill in the per-token time"}
    path = Path(args.outdir) / result_name(env, "http_tokens" + (f"_{args.tag}" if args.tag else ""))
    write_result(path, "http_tokens", env, rows, **summary)
    print(json.dumps(summary), f"{len(rows) - equal} differ; wrote {path}")


def logits_of(model, config):
    """``ids -> float32 logits of the last position`` of ``model`` on a torch-backend cache of its own (CPU)."""
    import torch

    from piecegraph.attention import AttentionMetadata, KVCache
    from piecegraph.context import forward_context

    def logits(ids: list[int]) -> torch.Tensor:
        cache = KVCache.for_sequences(config, 1, len(ids) + 1, dtype=torch.float32, device="cpu", backend="torch")
        meta = AttentionMetadata.for_batch(cache, [(0, 0, len(ids))])
        with forward_context(meta), torch.no_grad():
            hidden = model(torch.tensor(ids), meta.positions)
            return model.logits(hidden[-1:])[0].float()
    return logits


def judge(reference: dict, divergences: list[dict], logits) -> list[dict]:
    """One row per divergence (``{"request", "position", "served_token"?}``): the position, the engine's token,
    the reference's top two there and the bf16 steps between the engine's token and the runner-up (and the
    server's token, when recorded). ``reference``: ``{"prompts", "tokens"}``; ``logits``: :func:`logits_of`."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
    from bf16_ties import bf16_steps  # the judge the GPU tests use

    rows = []
    for entry in divergences:
        i, at = entry["request"], entry["position"]
        prompt, engine = reference["prompts"][i], reference["tokens"][i]
        if at >= len(engine):
            rows.append({"request": i, "position": at, "note": "lengths differ, no token to judge"})
            continue
        values = logits(list(prompt) + list(engine[:at]))
        top2 = torch.topk(values, 2).indices.tolist()
        mine = engine[at]
        other = top2[1] if top2[0] == mine else top2[0]
        row = {"request": i, "position": at, "engine_token": mine, "reference_top2": top2,
               "steps_to_runner_up": round(bf16_steps(values, mine, other), 3)}
        served = entry.get("served_token")
        if served is not None:
            row["served_token"] = served
            row["steps_to_served"] = round(bf16_steps(values, mine, served), 3)
        rows.append(row)
    return rows


def judge_files(args: argparse.Namespace) -> None:
    import torch

    from piecegraph.cli_common import load_model
    from piecegraph.models import QWEN2_5_0_5B, TINY

    reference = read_reference(args.reference)
    presets = {"qwen2.5-0.5b": QWEN2_5_0_5B, "tiny": TINY}
    rows = []
    for path in args.checks:
        result = load_result(path)
        name = result.env["model"]
        if name not in presets:
            raise SystemExit(f"{path}: model {name!r} is not a preset this judge rebuilds ({', '.join(presets)})")
        if result.extra.get("prompts") != len(reference["prompts"]):
            raise SystemExit(f"{path} checked {result.extra.get('prompts')} prompts, {args.reference} holds "
                             f"{len(reference['prompts'])}: not the same check")
        model = load_model(name, "cpu", torch.bfloat16).float()  # bf16 weights, float32 arithmetic
        judged = judge(reference, [r for r in result.rows if not r.get("equal", False)],
                       logits_of(model, presets[name]))
        for row in judged:
            row["check"] = os.path.basename(path)
            print(json.dumps(row))
        rows += judged
    if args.out:
        env = environment(attention="torch", model=reference["env"].get("model"), dtype="float32", quant=None,
                          gpu="cpu", checked_on=reference["env"].get("gpu"))
        path = Path(args.out) / result_name(env, "http_tokens_judge")
        write_result(path, "http_tokens_judge", env, rows)
        print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("check", help="the server's greedy tokens against an in-process engine's")
    one.add_argument("url")
    one.add_argument("model")
    one.add_argument("outdir")
    one.add_argument("--prompts", type=int, default=16)
    one.add_argument("--new", type=int, default=64)
    one.add_argument("--max-num-seqs", type=int, default=1024)
    one.add_argument("--max-batched-tokens", type=int, default=2048)
    one.add_argument("--max-seq-len", type=int, default=832)
    one.add_argument("--mode", default="auto")
    one.add_argument("--device", default="cuda", help="cuda (bf16, FlashInfer, Inductor) | cpu (a dry run)")
    one.add_argument("--reference", help="the engine's tokens and times: read when the file exists, else written")
    one.add_argument("--tag", default="", help="appended to the result file's name (e.g. fresh, after_load)")
    two = sub.add_parser("judge", help="are a check's divergences bf16 near-ties? (CPU)")
    two.add_argument("reference")
    two.add_argument("checks", nargs="+")
    two.add_argument("--out", help="write the judged rows as a result file in this folder")
    args = parser.parse_args()
    (check if args.what == "check" else judge_files)(args)


if __name__ == "__main__":
    main()
