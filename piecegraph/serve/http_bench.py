"""``serve-bench --url``: the closed-loop benchmark over HTTP against any OpenAI-compatible server.

The same workload as the in-process benchmark (:class:`~piecegraph.serve.bench.Workload`, token-id prompts, no
EOS: ``ignore_eos``, as vLLM's and SGLang's benchmark clients send), streamed: TTFT is the first event that
carries output, ITL the gaps between token events (tokens that arrive in one event share its time, as tokens of
one engine step do in process). Tokens are counted from ``token_ids`` in the events when the server returns them
(``return_token_ids``: piecegraph, vLLM), else one per non-empty event, and the total from ``usage``; the prompt
tokens the server's prefix cache held from ``usage.prompt_tokens_details.cached_tokens`` (0 when it says none).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections import deque
from typing import Any, Sequence

from piecegraph.serve.bench import metrics as summarize_requests


class _Done:
    """One finished HTTP request in the shape :func:`piecegraph.serve.bench.metrics` reads."""

    def __init__(self, prompt: Sequence[int], arrival: float) -> None:
        self.prompt, self.arrival = prompt, arrival
        self.output: Any = []
        self.token_times: list[float] = []
        self.preemptions = self.cached_tokens = 0

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None


async def _one(conn: Any, model: str, prompt: list[int], max_new: int, token_ids: bool) -> _Done:
    body = {"model": model, "prompt": prompt, "max_tokens": max_new, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if token_ids:
        body["return_token_ids"] = True
    done = _Done(prompt, time.monotonic())
    usage, count, times = None, 0, done.token_times
    async for line in conn.post_stream("/v1/completions", body):
        if not line.startswith(b"data: {"):
            continue
        now = time.monotonic()
        n = _count_ids(line) if b'"usage"' not in line and not line.startswith(b'data: {"error"') else None
        if n is None:  # no token ids to count, the usage chunk or an error: parse it
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(f"stream error: {data['error']}")
            usage = data.get("usage") or usage
            for choice in data.get("choices") or ():
                ids = choice.get("token_ids")
                n = (n or 0) + (len(ids) if ids is not None else int(bool(choice.get("text"))))
        if n:
            count += n
            times += [now] * n
    if usage and usage.get("completion_tokens", 0) > count:  # a server that merges tokens per event
        count = usage["completion_tokens"]
    done.output = range(count)
    done.cached_tokens = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return done


def _count_ids(line: bytes) -> int | None:
    """The number of ids in a chunk's one ``"token_ids": [...]`` without parsing the JSON (the client must not be
    what the benchmark measures); ``None`` when there is no such list. Inside JSON text a quote is escaped, so the
    key cannot appear in generated text."""
    at = line.find(b'"token_ids":')
    if at < 0 or line.find(b'"token_ids":', at + 12) >= 0:  # none, or several choices: parse instead
        return None
    start = at + 12
    while line[start:start + 1] == b" ":
        start += 1
    if line[start:start + 1] != b"[":
        return None
    end = line.find(b"]", start)
    inner = line[start + 1:end].strip()
    return inner.count(b",") + 1 if inner else 0


async def _loop(url: str, model: str, work: Sequence[tuple[list[int], int]], concurrency: int, token_ids: bool,
                timeout_s: float, start_at: float = 0.0) -> tuple[list[_Done], float, float]:
    from piecegraph.serve.sse_client import Connection

    todo, done = deque(work), []

    async def client_loop() -> None:
        async with Connection(url, timeout_s) as conn:
            while todo:
                prompt, max_new = todo.popleft()
                done.append(await _one(conn, model, prompt, max_new, token_ids))

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))  # shards in other processes start together
    start = time.monotonic()
    await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(todo)))))
    return done, start, time.monotonic()


def _shard(url: str, model: str, work: Sequence[tuple[list[int], int]], concurrency: int, token_ids: bool,
           timeout_s: float, start_at: float) -> tuple[list[tuple[int, int, float, list[float], int]], float, float]:
    """One client process's share: its requests as ``(prompt tokens, output tokens, arrival, token times, cached
    prompt tokens)``."""
    try:
        import uvloop  # the client's own overhead must not be what is measured

        uvloop.install()
    except ImportError:
        pass
    done, start, end = asyncio.run(_loop(url, model, work, concurrency, token_ids, timeout_s, start_at))
    return [(len(d.prompt), len(d.output), d.arrival, d.token_times, d.cached_tokens) for d in done], start, end


def client_processes(concurrency: int) -> int:
    """Client processes for ``concurrency`` streams: one up to 64 (latency at low concurrency is measured from
    one light process), then one per 128 streams, at most half the cores (the server needs the rest)."""
    if concurrency <= 64:
        return 1
    return max(1, min(-(-concurrency // 128), (os.cpu_count() or 2) // 2))


def _run_clients(url: str, model: str, work: Sequence[tuple[list[int], int]], concurrency: int, token_ids: bool,
                 timeout_s: float) -> tuple[list[_Done], float]:
    procs = min(client_processes(concurrency), concurrency)
    if procs == 1:
        done, start, end = _shard(url, model, work, concurrency, token_ids, timeout_s, 0.0)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(time.sleep, [0.5] * procs))  # every worker started and imported before the clock
            start_at = time.monotonic() + 0.2
            jobs = [pool.submit(_shard, url, model, work[i::procs], concurrency // procs + (i < concurrency % procs),
                                token_ids, timeout_s, start_at) for i in range(procs)]
            shards = [job.result() for job in jobs]
        done = [row for rows, _, _ in shards for row in rows]
        start, end = min(s for _, s, _ in shards), max(e for _, _, e in shards)
    requests = []
    for prompt_len, n, arrival, times, cached in done:
        d = _Done(range(prompt_len), arrival)
        d.output, d.token_times, d.cached_tokens = range(n), times, cached
        requests.append(d)
    return requests, end - start


def served_model(url: str) -> tuple[str, int]:
    """The first model ``url``'s ``/v1/models`` lists, and its vocabulary size when the server says (piecegraph
    does; others: 256, ids every tokenizer has)."""
    from urllib.request import urlopen

    with urlopen(f"{url}/v1/models", timeout=30) as response:  # the standard library: the client needs no extras
        data = json.loads(response.read())["data"][0]
    return data["id"], int(data.get("vocab_size") or 256)


def measure_url(url: str, model: str, work: Sequence[tuple[list[int], int]], concurrency: int, *,
                token_ids: bool = True, timeout_s: float = 600.0) -> dict[str, Any]:
    """One concurrency over HTTP: throughput, TTFT and ITL like :func:`piecegraph.serve.bench.measure`; above 64
    streams the clients are spread over several processes (:func:`client_processes`)."""
    done, seconds = _run_clients(url.rstrip("/"), model, work, concurrency, token_ids, timeout_s)
    if len(done) != len(work):
        raise RuntimeError(f"{len(done)} of {len(work)} requests finished")
    return {"concurrency": concurrency, **summarize_requests(done, seconds)}


ENGINE_SERIES = {"piecegraph_engine_loop_seconds_total": "part", "piecegraph_engine_step_phase_seconds_total": "phase",
                 "piecegraph_engine_steps_total": "kind"}
# Unlabelled sums behind the TTFT split: the front ends' (arrival at the server to the first token sent) and the
# engine's own (request taken to its first token on the host)
TTFT_SERIES = ("piecegraph_time_to_first_token_seconds_sum", "piecegraph_time_to_first_token_seconds_count",
               "piecegraph_engine_time_to_first_token_seconds_total", "piecegraph_engine_first_tokens_total")
SETTLE_S = 1.5  # front ends share their metrics with each other once a second: a scrape after this sees all


def engine_counters(url: str) -> dict[str, dict[str, float]] | None:
    """The engine's counters from ``url``'s ``/metrics`` (a piecegraph server's: loop seconds by part, step
    seconds by phase, steps by kind; empty while none has reached the front end that answered), or ``None`` when
    the server is not piecegraph's (vLLM, SGLang, no ``/metrics``)."""
    from urllib.request import urlopen

    try:
        with urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name not in ENGINE_SERIES or "}" not in rest:
            plain, _, value = line.partition(" ")
            if plain in TTFT_SERIES:
                out.setdefault("ttft", {})[plain] = float(value)
            continue
        labels, _, value = rest.rpartition("} ")
        label = dict(part.split("=", 1) for part in labels.split(",")).get(ENGINE_SERIES[name], '""').strip('"')
        out.setdefault(name, {})[label] = float(value)
    return out if out or "\npiecegraph_" in f"\n{text}" else None


def engine_share(before: dict | None, after: dict | None, seconds: float) -> dict[str, Any] | None:
    """What the server's engine did between two :func:`engine_counters` scrapes around a run of ``seconds``: its
    loop's seconds by part and their share of the run (idle is not shared out: the scrapes' waits are in it),
    mean host ms per step by phase, steps (and by graph kind: a mix other than the in-process run's changes the
    host ms per step), and (``ttft_mean_ms``) the mean TTFT at the server (arrival to first
    token sent) beside the engine's own part of it; ``None`` without both scrapes."""
    if not before or not after:  # not piecegraph's server, or no engine counters had arrived at a scrape
        return None

    def delta(name: str) -> dict[str, float]:
        now, then = after.get(name, {}), before.get(name, {})
        return {k: v - then.get(k, 0.0) for k, v in now.items()}

    loop, phases = delta("piecegraph_engine_loop_seconds_total"), delta("piecegraph_engine_step_phase_seconds_total")
    by_kind = {k: int(v) for k, v in delta("piecegraph_engine_steps_total").items() if v}
    steps = sum(by_kind.values())
    busy = {k: v for k, v in loop.items() if k != "idle"}
    out = {"steps": steps, "steps_by_kind": by_kind, "loop_s": {k: round(v, 4) for k, v in loop.items()},
           "loop_share": {k: round(v / seconds, 4) for k, v in busy.items()} if seconds > 0 else {},
           "phase_ms_per_step": {k: round(1e3 * v / steps, 4) for k, v in phases.items()} if steps else {}}
    ttft = delta("ttft")
    server_s, server_n, engine_s, engine_n = (ttft.get(k, 0.0) for k in TTFT_SERIES)
    if server_n > 0 and engine_n > 0:  # mean ms: at the server (arrival to first token sent), in the engine
        out["ttft_mean_ms"] = {"server": round(1e3 * server_s / server_n, 3),
                               "engine": round(1e3 * engine_s / engine_n, 3)}
    return out


def describe_share(share: dict[str, Any] | None) -> str:
    """One line for the log: the engine loop's busy shares of the run and the step phases."""
    if not share or not share["loop_share"]:
        return ""
    parts = " · ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(share["loop_share"].items(), key=lambda kv: -kv[1]))
    phases = ", ".join(f"{k} {v:.2f}" for k, v in share["phase_ms_per_step"].items())
    ttft = share.get("ttft_mean_ms")
    split = f"; TTFT mean at the server {ttft['server']:.2f} ms, in the engine {ttft['engine']:.2f}" if ttft else ""
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(share.get("steps_by_kind", {}).items()))
    return (f"engine loop busy: {parts} of the run; {share['steps']} steps ({kinds}), host ms per step: "
            f"{phases}{split}")


def bench_url(url: str, workload: Any, concurrencies: Sequence[int], counts: dict[int, int], *, warmup: int = 2,
              token_ids: bool = True, log: Any = print, repeats: int = 1) -> dict[str, Any]:
    """Every concurrency against ``url`` (after ``warmup`` short requests), each run ``repeats`` times (the
    median run is reported); a result in the in-process sweep's shape (``mode`` ``"http"``, one row per
    concurrency), so its tables and JSON apply."""
    from piecegraph.serve.bench import Workload, median_run

    url = url.rstrip("/")
    model, vocab = served_model(url)
    result: dict[str, Any] = {"mode": "http", "url": url, "model": model, "rows": []}
    if warmup:
        warm = Workload(min(workload.input_len, 64), min(workload.output_len, 8), 0.0, workload.seed)
        measure_url(url, model, warm.requests(warmup, vocab, salt=-1), warmup, token_ids=token_ids)
    counters = _settled_counters(url)

    def run(c: int) -> dict[str, Any]:  # one run, with what the server's engine did meanwhile
        nonlocal counters
        row = {"mode": "http", **measure_url(url, model, workload.requests(counts[c], vocab, salt=c), c,
                                             token_ids=token_ids)}
        before, counters = counters, _settled_counters(url) if counters is not None else None
        share = engine_share(before, counters, row["duration_s"])
        if share:
            row["server_engine"] = share
        return row

    for c in concurrencies:
        row = median_run(lambda c=c: run(c), repeats)
        share = row.get("server_engine")
        result["rows"].append(row)
        log(f"http c={c}: {row['requests']} requests in {row['duration_s']:.2f} s, {row['output_tok_s']:.0f} output "
            f"tok/s, TTFT p50 {row['ttft_p50_ms']:.1f} ms, ITL p50 {row['itl_p50_ms'] or 0:.2f} ms")
        if share:
            log(f"  {describe_share(share)}")
    return result


def _settled_counters(url: str) -> dict | None:
    counters = engine_counters(url)
    if counters is not None:  # a piecegraph server: let every front end's share of the counters arrive first
        time.sleep(SETTLE_S)
        counters = engine_counters(url)
    return counters


def run_cli(url: str, workload: Any, concurrencies: Sequence[int], counts: dict[int, int],
            rounds: tuple[float, int, int], warmup: int, json_path: Any, plot_path: Any, console: Any,
            repeats: int = 1) -> None:
    """``serve-bench --url``: every concurrency (``counts[c]`` requests, else the rounds rule of ``rounds`` =
    ``(rounds, min_requests, max_requests)``), the serving table, the JSON and the PNG when asked."""
    import typer

    from piecegraph.results.schema import write_result
    from piecegraph.serve.bench import requests_for
    from piecegraph.serve.report import payload, plot, table

    counts = {c: counts.get(c) or requests_for(c, *rounds) for c in concurrencies}
    console.print(f"[bold]serve-bench --url[/] {url}: concurrency {list(concurrencies)}, requests "
                  f"{[counts[c] for c in concurrencies]}, {workload.input_len} in / {workload.output_len} out")
    try:
        result = bench_url(url, workload, concurrencies, counts, warmup=warmup, repeats=repeats,
                           log=lambda line: console.print(line, markup=False, highlight=False))
    except Exception as err:  # noqa: BLE001  (a refused connection or a server error: say it, exit 1)
        console.print(f"[red]serve-bench --url {url} failed: {type(err).__name__}: {err}[/]")
        raise typer.Exit(1) from None
    from piecegraph.results.schema import environment

    # The server's own device, dtype and attention are not visible over HTTP: gpu is the client's machine's (the
    # server's too when it runs there, as the GPU check runs it), the others null.
    env = environment(attention=None, model=result["model"], dtype=None, quant=None, url=url,
                      gpu_of="the client's machine", workload=dataclasses.asdict(workload),
                      concurrency=list(concurrencies), requests=counts, warmup=warmup, repeats=repeats,
                      timing="client wall time (time.monotonic: one clock for all client processes) at each "
                             "streamed event")
    title = f"serving over HTTP: {result['model']} at {url}; latencies in ms"
    console.print(table([result], title))
    if json_path:
        write_result(json_path, **payload(env, [result]))
        console.print(f"wrote {json_path}")
    if plot_path:
        plot([result], plot_path, title=title)
        console.print(f"wrote {plot_path}")
