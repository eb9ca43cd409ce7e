"""What the HTTP path costs per streamed token, measured without a model: the server's real code path (FastAPI on
uvicorn, the engine loop in its own process, TextStream, SSE) over a stand-in engine that emits one token per
running request per step and does no model work, driven by ``serve-bench --url``'s own client.

    python scripts/http_overhead.py                          # c = 1, 64, 256; engine in its own process
    python scripts/http_overhead.py -c 256 --step-ms 8 --tokens 128 --requests 1024
    python scripts/http_overhead.py --engine thread          # the engine on a thread of the server process
    python scripts/http_overhead.py -c 64 --profile          # py-spy top-functions of the HTTP process (if present)
    python scripts/http_overhead.py -c 10,256,1024 --step-ms 10   # a GPU-like step: tokens are not merged at 256

For each concurrency it prints output tok/s, TTFT and ITL p50, and CPU microseconds per streamed token of the HTTP
server process (everything but the engine), of the engine process (the stand-in: its loop, pickling, the pipe)
and of the client (HTTP, SSE parsing, counting), from ``/proc/PID/stat`` (Linux) and ``getrusage``. TTFT is
compared with the stand-in's own step time (``--step-ms``): what is left is the HTTP path's latency.

Constraints: Linux (``/proc``); the server runs in a child process so the client never shares its interpreter
lock; on a machine with few cores, the three processes share them, so tok/s is a lower bound, while CPU
microseconds per token are what to compare between versions. The stand-in's steps sleep for ``--step-ms``
(a GPU step releases the lock while the host waits) and then emit printable ASCII tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from types import SimpleNamespace


class StandInEngine:
    """The surface :class:`~piecegraph.server.loop.EngineLoop` uses, with no model: ``step`` sleeps ``step_s`` and
    appends one token to each running request (the first at its first step, as a prefill does)."""

    def __init__(self, max_num_seqs: int = 256, step_s: float = 0.0, vocab_size: int = 256) -> None:
        self.config = SimpleNamespace(max_seq_len=1 << 16, max_num_seqs=max_num_seqs)
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size, max_seq_len=1 << 16))
        self.cache = SimpleNamespace(num_pages=1 << 20, num_free_pages=(1 << 20) - 1)
        self.device, self.setup_s, self.steps, self.step_s = None, 0.0, [], step_s
        self._waiting: list = []
        self._running: dict = {}

    def add_request(self, prompt, params, *, id):  # noqa: A002  (the engine's own keyword)
        request = SimpleNamespace(id=id, prompt=prompt, max_new=params.max_new_tokens, output=[], finish_reason=None)
        self._waiting.append(request)
        return request

    def abort(self, request_id) -> None:
        request = self._running.pop(request_id, None)
        if request is not None:
            request.finish_reason = "aborted"
        self._waiting = [r for r in self._waiting if r.id != request_id]

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list:
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            request = self._waiting.pop(0)
            self._running[request.id] = request
        if self.step_s:
            time.sleep(self.step_s)
        done = []
        for request in self._running.values():
            request.output.append(97 + len(request.output) % 26)  # a..z: one character per token
            if len(request.output) >= request.max_new:
                request.finish_reason = "length"
                done.append(request)
        for request in done:
            del self._running[request.id]
        self.steps.append(SimpleNamespace(kind="standin"))
        return done

    def reset_stats(self) -> None:
        self.steps = []


def make_engine(max_num_seqs: int, step_s: float) -> StandInEngine:
    return StandInEngine(max_num_seqs, step_s)


def _serve(args: argparse.Namespace) -> None:
    """The server child: build the state, print ``{"port", "pid", "engine_pid"}``, serve until stdin closes."""
    import functools
    import threading

    from piecegraph.server.run import BackgroundServer, build_process_state, build_state
    from piecegraph.server.tokenizer import ByteTokenizer

    if args.engine == "process":
        state = build_process_state(functools.partial(make_engine, args.max_num_seqs, args.step_ms / 1e3),
                                    ByteTokenizer, "standin", max_pending=1 << 16, drain_s=1)
        engine_pid = state.loop._proc.pid
    else:
        state = build_state(make_engine(args.max_num_seqs, args.step_ms / 1e3), ByteTokenizer(), "standin",
                            max_pending=1 << 16, drain_s=1)
        engine_pid = None
    with BackgroundServer(state) as server:
        print(json.dumps({"port": server.port, "pid": os.getpid(), "engine_pid": engine_pid}), flush=True)
        done = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
        done.wait()


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` (all its threads), from ``/proc``."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(url: str, c: int, requests: int, tokens: int, info: dict, timeout_s: float = 600.0) -> dict:
    import asyncio

    from piecegraph.serve.bench import metrics
    from piecegraph.serve.http_bench import _loop

    work = [([1 + (i + j) % 200 for j in range(16)], tokens) for i in range(requests)]
    before = (_cpu_s(info["pid"]), _cpu_s(info["engine_pid"]), _client_cpu_s())
    done, start, end = asyncio.run(_loop(url, "standin", work, c, True, timeout_s))
    after = (_cpu_s(info["pid"]), _cpu_s(info["engine_pid"]), _client_cpu_s())
    out = sum(len(d.output) for d in done)
    row = metrics(done, end - start)
    server, engine, client = (1e6 * (a - b) / out for a, b in zip(after, before))
    return {"c": c, "tok_s": row["output_tok_s"], "ttft_p50_ms": row["ttft_p50_ms"], "itl_p50_ms": row["itl_p50_ms"],
            "server_us_tok": server, "engine_us_tok": engine, "client_us_tok": client, "tokens": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--concurrency", default="1,64,256", help="comma-separated concurrencies")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--requests", type=int, default=0, help="requests per concurrency (0: max(16, 4 c))")
    parser.add_argument("--step-ms", type=float, default=2.0, help="the stand-in engine's step time")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--engine", choices=("process", "thread"), default="process")
    parser.add_argument("--profile", action="store_true", help="py-spy the HTTP process during the last run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (a hang fails)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return _serve(args)
    try:
        import uvloop  # as serve-bench's client does

        uvloop.install()
    except ImportError:
        pass
    cmd = [sys.executable, __file__, "--serve", "--engine", args.engine, "--step-ms", str(args.step_ms),
           "--max-num-seqs", str(args.max_num_seqs)]
    server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        info = json.loads(server.stdout.readline())
        url = f"http://127.0.0.1:{info['port']}"
        _measure(url, 4, 8, 8, info)  # warm-up: imports, first connections
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        for i, c in enumerate(concurrencies):
            spy = None
            if args.profile and i == len(concurrencies) - 1:
                spy = subprocess.Popen(["py-spy", "record", "--pid", str(info["pid"]), "--format", "raw",
                                        "--output", "http_overhead.pyspy.txt", "--threads", "--rate", "500"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            row = _measure(url, c, args.requests or max(16, 4 * c), args.tokens, info, args.timeout)
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
            rows.append(row)
            print(f"c={c:5d}: {row['tok_s']:8.0f} tok/s  TTFT p50 {row['ttft_p50_ms']:6.2f} ms (step "
                  f"{args.step_ms} ms)  ITL p50 {row['itl_p50_ms'] or 0:5.2f} ms  CPU us/token: HTTP server "
                  f"{row['server_us_tok']:6.1f}  engine process {row['engine_us_tok']:6.1f}  client "
                  f"{row['client_us_tok']:6.1f}", flush=True)
    finally:
        server.stdin.close()
        server.wait(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
