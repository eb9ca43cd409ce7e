"""``piecegraph serve``: an OpenAI-compatible HTTP server on the continuous-batching engine."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch
import typer
from rich.console import Console

from piecegraph.cli_common import PRESETS, default_model, load_model, resolve_attention, resolve_device
from piecegraph.config import FULL_COMPILE
from piecegraph.server.affinity import available_cpus, format_cpus, pin, split_cpus

console = Console()


def serve(
    model_arg: str | None = typer.Argument(None, metavar="MODEL", help="a preset (tiny, qwen2.5-0.5b, tiny-moe, ...) | "
                                           "a local Hugging Face directory | a .gguf file (default: tiny on CPU, the "
                                           "0.5B shape on GPU)"),
    model: str | None = typer.Option(None, "--model", help="the same as MODEL"),
    hf: bool = typer.Option(False, "--hf", help="run the directory's transformers model itself (piecegraph.hf)"),
    host: str = typer.Option("127.0.0.1", help="address to bind (0.0.0.0 exposes the server to the network)"),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port"),
    served_model_name: str | None = typer.Option(None, help="the name clients pass as `model` (default: the "
                                                 "preset or the directory's name)"),
    mode: str | None = typer.Option(None, help="engine mode: eager | breakable | piecewise | auto (default: auto "
                                    "on GPU; eager on CPU, where there are no CUDA graphs to capture)"),
    compiler: str | None = typer.Option(None, help="inductor | eager (default: inductor on GPU, eager on CPU)"),
    emulate: bool | None = typer.Option(None, "--emulate/--no-emulate", help="emulate graph replay (default: on "
                                        "CPU, where CUDA graphs cannot run)"),
    max_num_seqs: int = typer.Option(0, min=0, help="most running requests (0: 256 on GPU, 32 on CPU)"),
    max_batched_tokens: int = typer.Option(0, min=0, help="per-step token budget, chunked prefill above it (0: "
                                           "2048 on GPU, 256 on CPU)"),
    max_seq_len: int = typer.Option(0, min=0, help="longest request, prompt + output (0: the model's)"),
    num_pages: int = typer.Option(0, min=0, help="KV pages (0: room for every running request at full length "
                                   "when that fits in 85% of the free GPU memory, else what fits)"),
    page_size: int = typer.Option(16, min=1, help="tokens per KV page"),
    max_pending: int = typer.Option(0, min=0, help="requests admitted at once, running or waiting; more get 429 "
                                    "(0: four times --max-num-seqs)"),
    drain: float = typer.Option(30.0, min=0.0, help="seconds in-flight requests may finish at shutdown before "
                                "they are aborted"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    attention: str = typer.Option("auto", help="auto | torch | flashinfer (auto: FlashInfer on a GPU that has it)"),
    log_level: str = typer.Option("info", help="uvicorn and server log level"),
    engine_process: bool = typer.Option(True, "--engine-process/--engine-thread", help="run the engine in its own "
                                        "process (default: the HTTP work then never takes its interpreter lock) "
                                        "or on a thread of the server process"),
    api_servers: int = typer.Option(0, "--api-servers", min=0, help="HTTP front-end processes on the port, each "
                                    "with its own pipes to the engine process (0: 1 on CPU, on a GPU up to 4, one "
                                    "per 4 cores); one front end streams ~30-45k tokens/s"),
    engine_cpus: str = typer.Option("none", "--engine-cpus", help="CPUs of the engine process's own: none (share "
                                    "them all) | auto (the 2 highest, on a machine of 8 or more) | a list such as "
                                    "14-15; the API servers then run on the others. Linux, --engine-process only"),
    idle_spin_ms: float | None = typer.Option(None, "--engine-idle-spin-ms", min=0.0, help="how long the idle "
                                              "engine process polls for a request before it sleeps, in ms (keeps a "
                                              "lone client's TTFT low, costs a core meanwhile; default: 50 on a "
                                              "GPU, 0 on CPU)"),
    cache: bool = typer.Option(True, "--cache/--no-cache", help="keep compiled code in piecegraph's artifact cache "
                               "($PIECEGRAPH_CACHE_DIR, else the user's cache folder: piecegraph cache info) so a "
                               "restart skips tracing and compiling; Inductor-compiled engines only (the GPU "
                               "default; on CPU the default compiler is eager: nothing to cache)"),
    full_compile: str = typer.Option("auto", "--full-compile", help="auto | whole | pieces: auto's decode "
                                     "module compiled as one graph, or by pieces (a faster cold start; with --cache "
                                     "the whole graph is packaged in the background and swapped in once ready); "
                                     "auto: by pieces where that swap will come"),
    share_trace: bool = typer.Option(True, "--share-trace/--no-share-trace", help="auto's decode module builds "
                                     "from the piecewise module's Dynamo trace instead of tracing again (compiled "
                                     "by pieces, it takes its compiled pieces too): a faster start"),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help="share the KV pages of "
                                      "cached prompt prefixes between requests (usage.prompt_tokens_details."
                                      "cached_tokens says how many tokens a request found cached)"),
    mixed_graphs: bool = typer.Option(True, "--mixed-graphs/--no-mixed-graphs", help="auto: prompt steps of few "
                                      "sequences replay full CUDA graphs too, where the attention backend can "
                                      "capture them (FlashInfer) and they were timed faster at start"),
) -> None:
    """Serve MODEL over HTTP, OpenAI-compatible: /v1/completions, /v1/chat/completions (streaming too),
    /v1/models, /health, /metrics. Try: piecegraph serve --model tiny."""
    try:
        import uvicorn  # noqa: F401  (checked here: a clear message instead of an ImportError deep in the app)
    except ImportError:
        raise typer.BadParameter("the server needs FastAPI and uvicorn: pip install 'piecegraph[server]'",
                                 param_hint="serve") from None
    from piecegraph.serve.config import ENGINE_MODES, EngineConfig
    from piecegraph.server.app import create_app
    from piecegraph.server.frontends import FrontEnds, listening_socket
    from piecegraph.server.run import build_process_state, build_state, http_stack
    from piecegraph.server.tokenizer import load_tokenizer
    from piecegraph.server.uvicorn_server import draining_server, uvicorn_config

    if model_arg and model and model_arg != model:
        raise typer.BadParameter(f"MODEL {model_arg!r} and --model {model!r} disagree; give one", param_hint="--model")
    if mode is not None and mode not in ENGINE_MODES:
        raise typer.BadParameter(f"{mode!r} is not one of {', '.join(ENGINE_MODES)}", param_hint="--mode")
    if compiler not in (None, "inductor", "eager"):
        raise typer.BadParameter(f"{compiler!r} is not inductor or eager", param_hint="--compiler")
    if full_compile not in FULL_COMPILE:
        raise typer.BadParameter(f"{full_compile!r} is not one of {', '.join(FULL_COMPILE)}",
                                 param_hint="--full-compile")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("piecegraph.server").setLevel(log_level.upper())  # capture logs stay quiet, ours do not
    device = resolve_device(device)
    backend = resolve_attention(attention, device)
    gpu = device == "cuda"
    name = default_model(model_arg or model or "auto", device)
    source, name = name, gguf_to_folder(name)
    dtype = torch.bfloat16 if backend == "flashinfer" or (gpu and name in PRESETS) else torch.float32
    if name not in PRESETS and not Path(name).is_dir():
        raise typer.BadParameter(f"{name!r} is not one of {', '.join(PRESETS)} or a local directory",
                                 param_hint="MODEL")
    quant = checkpoint_note(name, device, dtype, hf)  # read before the engine's minutes: a bad config fails now
    chosen = mode is None and not gpu
    mode = mode or ("auto" if gpu else "eager")
    config = EngineConfig(mode=mode, max_num_seqs=max_num_seqs or (256 if gpu else 32),
                          max_num_batched_tokens=max_batched_tokens or (2048 if gpu else 256),
                          num_pages=num_pages or None, page_size=page_size, max_seq_len=max_seq_len or None,
                          compiler=compiler or ("inductor" if gpu else "eager"),
                          emulate_graphs=not gpu if emulate is None else emulate, attention_backend=backend,
                          cache_dir=cache, full_compile=full_compile,
                          share_trace=share_trace, prefix_cache=prefix_cache,  # cache True: the default folder
                          mixed_graphs=mixed_graphs)
    if chosen:
        kv = "" if num_pages else (", KV cache sized to a quarter of the available memory, at most 4 GiB "
                                   "(--num-pages overrides)")
        console.print("on CPU: engine mode eager (no CUDA graphs there: tracing and capturing sizes would cost "
                      f"minutes of start for nothing; --mode overrides){kv}")
    frontends = api_servers or (default_api_servers(gpu) if engine_process else 1)
    if frontends > 1 and not engine_process:
        raise typer.BadParameter("several API servers need the engine in its own process (--engine-process)",
                                 param_hint="--api-servers")
    cpus = cpu_split(engine_cpus, engine_process)
    spin_ms = idle_spin_ms if idle_spin_ms is not None else 50.0 if gpu else 0.0
    try:  # bound before the engine's minutes of start-up: a taken port fails now
        sock = listening_socket(host, port, reuse_port=frontends > 1)
    except OSError as err:
        raise typer.BadParameter(str(err), param_hint="--port") from None
    factory = functools.partial(build_engine, name, device, dtype, hf, config)
    served = served_model_name or (name if name in PRESETS else Path(source).stem if source != name
                                   else Path(name).resolve().name)
    if engine_process:
        console.print("starting the engine process (load, trace, compile, capture)")
        state = build_process_state(factory, functools.partial(load_tokenizer, name), served,
                                    max_pending=max_pending or None, drain_s=drain, frontends=frontends,
                                    engine_cpus=cpus and cpus[0], idle_spin_s=spin_ms / 1e3)
        if cpus:  # this process and the front ends it spawns below keep off the engine's CPUs
            pin(cpus[1])
        setup_s = state.loop.info["setup_s"]
    else:
        engine = factory()
        state = build_state(engine, load_tokenizer(name, engine.model.config.vocab_size), served,
                            max_pending=max_pending or None, drain_s=drain)
        setup_s = engine.setup_s
    console.print(f"[bold]piecegraph serve[/]: {served} on {device} ({str(dtype).removeprefix('torch.')}, "
                  f"{backend} attention, {state.tokenizer.name} tokenizer{quant}), engine mode {mode} "
                  f"({'own process' if engine_process else 'a thread'}), up to {config.max_num_seqs} running / "
                  f"{state.loop.max_pending} admitted requests of up to {state.max_seq_len} tokens; engine ready in "
                  f"{setup_s:.1f} s")
    stack, hint = http_stack()
    fronts = FrontEnds(state, host, port, log_level=log_level) if frontends > 1 else None
    if fronts is not None:
        fronts.start()
    servers = f"{frontends} API server processes, " if frontends > 1 else ""
    if cpus:
        servers += f"engine on CPU {format_cpus(cpus[0])}, API on {format_cpus(cpus[1])}, "
    console.print(f"OpenAI-compatible API at http://{host}:{port}/v1 (model {served!r}, {servers}{stack}); Ctrl-C "
                  f"stops it, letting requests in flight finish for up to {drain:g} s")
    if hint:
        console.print(f"[yellow]note[/]: {hint}")
    server = draining_server(state, uvicorn_config(create_app(state), host=host, port=port, drain_s=drain,
                                                   log_level=log_level), on_shutdown=fronts and fronts.signal)
    try:
        server.run(sockets=[sock])
    finally:
        if fronts is not None:
            fronts.stop()
        sock.close()


def gguf_to_folder(name: str) -> str:
    """``name`` itself, unless it is a GGUF file: then the Hugging Face folder converted from it (once, in
    piecegraph's cache folder: :func:`piecegraph.hf.gguf.gguf_folder`), with one line saying which. A file that
    cannot be converted is a ``typer.BadParameter`` naming MODEL."""
    from piecegraph.hf.gguf import gguf_folder, gguf_folder_path, is_gguf

    if not is_gguf(name):
        return name
    if not (gguf_folder_path(name) / "config.json").is_file():
        console.print(f"converting the GGUF file {name} to a Hugging Face folder (once; float32 weights) ...")
    try:
        folder, converted = gguf_folder(name)
    except (ImportError, ValueError, OSError) as err:
        raise typer.BadParameter(f"cannot read the GGUF file {name}: {str(err).splitlines()[0]}",
                                 param_hint="MODEL") from None
    console.print(f"serving the GGUF file {name} from the Hugging Face folder {folder} ("
                  f"{'converted now' if converted else 'converted earlier'})")
    return str(folder)


def checkpoint_note(name: str, device: str, dtype: torch.dtype, hf: bool) -> str:
    """``", checkpoint fp8 (block 128x128) -> running float32 (dequantized on cpu)"``: the banner's words for a
    quantized checkpoint directory ``name`` (:mod:`piecegraph.models.quant_formats`), ``""`` for a plain one or a
    preset. A quantization piecegraph cannot read is a ``typer.BadParameter`` naming MODEL."""
    from piecegraph.cli_common import _needs_transformers
    from piecegraph.models.mla_loader import is_mla_folder
    from piecegraph.models.quant_formats import UnsupportedQuantization, engine_form, read_quant, running_note

    try:
        quant = read_quant(name) if Path(name).is_dir() else None
    except UnsupportedQuantization as err:
        raise typer.BadParameter(str(err), param_hint="MODEL") from None
    if quant is None:
        return ""
    if is_mla_folder(name):  # the MLA decoder dequantizes at load, on every device (models/mla_loader.py)
        return ", " + running_note(quant, "dequantized: the MLA decoder runs float weights", dtype)
    return ", " + running_note(quant, engine_form(quant, device, hf or _needs_transformers(name)), dtype)


def cpu_split(spec: str, engine_process: bool) -> tuple[frozenset[int], frozenset[int]] | None:
    """``--engine-cpus`` -> (engine CPUs, front-end CPUs), or ``None`` for no pinning; a bad value, a thread
    engine or an OS without CPU affinity -> ``typer.BadParameter`` naming the option."""
    if spec == "none":
        return None
    if not engine_process:
        raise typer.BadParameter("pinning needs the engine in its own process (--engine-process)",
                                 param_hint="--engine-cpus")
    if not hasattr(os, "sched_setaffinity"):
        raise typer.BadParameter("CPU affinity is Linux-only; use --engine-cpus none", param_hint="--engine-cpus")
    try:
        return split_cpus(spec, available_cpus())
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--engine-cpus") from None


def default_api_servers(gpu: bool) -> int:
    """Front-end processes when ``--api-servers`` is not given: one on CPU (the engine is the limit there); on a
    GPU one per 4 cores up to 4, since one streams ~30-45k tokens/s and an H200 engine makes more."""
    return max(1, min(4, (os.cpu_count() or 1) // 4)) if gpu else 1


def build_engine(name: str, device: str, dtype: torch.dtype, hf: bool, config: Any) -> Any:
    """Load ``name`` (see :func:`piecegraph.cli_common.load_model`) and build its engine with ``config``, its
    ``max_seq_len`` capped at the model's; a capture progress bar meanwhile. Top level: the engine process
    unpickles and calls it."""
    from piecegraph.serve.command import capture_progress
    from piecegraph.serve.engine import Engine

    net = load_model(name, device, dtype, hf=hf)
    limit = net.config.max_seq_len
    config = config.replace(max_seq_len=min(config.max_seq_len or limit, limit))
    with capture_progress() as progress:
        return Engine(net, config, progress=progress(config.mode))
