"""The server's parts without HTTP: incremental text equals whole decoding, stop strings and ids, the Prometheus
text, the engine loop's shutdown (finish or abort, pages freed), a model directory's tokenizer through
transformers served end to end (``--hf``), the CLI (``serve --help``, ``serve-bench --url``)."""

import asyncio
import random
import subprocess
import sys

import pytest
import torch

from piecegraph.models import TINY, Decoder
from piecegraph.serve import Engine, EngineConfig, SamplingParams
from piecegraph.serve.stats import PHASES
from piecegraph.server.metrics import SERIES, Metrics
from piecegraph.server.protocol import APIError, CompletionRequest, parse
from piecegraph.server.stream import TextStream
from piecegraph.server.tokenizer import ByteTokenizer, NoChatTemplate

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


def _feed_all(stream, ids, seed):
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids) and not stream.stopped:
        n = rng.randint(1, 4)
        out.append(stream.feed(ids[i:i + n])[0])
        i += n
    out.append(stream.finish())
    return "".join(out)


@pytest.mark.parametrize("seed", range(40))
def test_incremental_text_equals_decoding_everything(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["a", "é", "数", "😀", " ", "\n"]) for _ in range(30))
    ids = list(text.encode()) + [rng.randrange(256) for _ in range(rng.randint(0, 20))]  # invalid UTF-8 too
    assert _feed_all(TextStream(TOK), ids, seed) == TOK.decode(ids)
    big = ByteTokenizer(vocab_size=1000)  # ids above 255: markers
    ids = [rng.randrange(1000) for _ in range(30)]
    assert _feed_all(TextStream(big), ids, seed) == big.decode(ids)


@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_are_cut_and_never_leak_into_the_stream(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("abcdé ") for _ in range(60))
    start = rng.randrange(10, 50)
    stop = text[start:start + rng.randint(1, 4)]
    stream = TextStream(TOK, stop=[stop, "zzz"])
    sent = _feed_all(stream, list(text.encode()), seed)
    assert sent == text[:text.find(stop)] and stream.stopped


def test_stop_token_id_ends_the_text_and_is_kept_in_the_ids():
    stream = TextStream(TOK, stop_ids={ord("!")})
    delta, kept = stream.feed(list(b"hi! there"))
    assert delta + stream.finish() == "hi" and kept == list(b"hi!") and stream.stopped
    assert stream.feed(list(b"more")) == ("", [])


def test_byte_tokenizer_round_trip_and_its_chat_template():
    assert TOK.decode(TOK.encode("héllo 数")) == "héllo 数"
    assert TOK.decode(TOK.chat([("user", "hi")])) == "<|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(NoChatTemplate):
        ByteTokenizer(chat_template=False).chat([("user", "hi")])
    with pytest.raises(ValueError, match="256"):
        ByteTokenizer(vocab_size=100)


def test_metrics_text_format():
    metrics = Metrics(gauges=lambda: {"piecegraph_kv_pages_used": 3})
    metrics.inc("piecegraph_requests_total", finish_reason="stop")
    metrics.observe("piecegraph_time_to_first_token_seconds", 0.003, times=2)
    text = metrics.render()
    for name, (kind, _) in SERIES.items():
        assert f"# TYPE {name} {kind}" in text
    assert 'piecegraph_requests_total{finish_reason="stop"} 1' in text
    assert 'piecegraph_time_to_first_token_seconds_bucket{le="0.0025"} 0' in text
    assert 'piecegraph_time_to_first_token_seconds_bucket{le="0.005"} 2' in text
    assert "piecegraph_time_to_first_token_seconds_count 2" in text and "piecegraph_kv_pages_used 3" in text
    with pytest.raises(KeyError, match="not declared"):
        metrics.inc("nope")


def test_protocol_refuses_naming_the_field():
    with pytest.raises(APIError, match="^temperature") as err:
        parse(b'{"model": "m", "prompt": "x", "temperature": 3}', CompletionRequest)
    assert err.value.param == "temperature" and err.value.status == 400
    assert parse(b'{"model": "m", "prompt": [1, 2], "n": 1}', CompletionRequest).prompt == [1, 2]


class _Slow(Engine):
    def step(self):
        import time

        time.sleep(0.003)
        return super().step()


@pytest.mark.parametrize("drain_s", [0.0, 10.0])
def test_shutdown_finishes_or_aborts_in_flight_requests_and_frees_pages(drain_s, caplog):
    from piecegraph.server.loop import EngineLoop

    engine = _Slow(Decoder.random(TINY, seed=1).eval(), EngineConfig(mode="eager", max_num_seqs=4, page_size=8,
                                                                     max_seq_len=128))
    loop = EngineLoop(engine, max_pending=8)

    async def main():
        tickets = [loop.submit([1, 2, 3], SamplingParams(max_new_tokens=100)) for _ in range(3)]
        loop.start()
        for t in tickets:
            assert (await t.events.get()).error is None  # accepted
        await asyncio.to_thread(loop.close, drain_s)
        return tickets

    with caplog.at_level("INFO", logger="piecegraph.server"):
        tickets = asyncio.run(main())
    ids = {t.id for t in tickets}
    if drain_s:
        assert set(loop.finished_at_close) == ids and not loop.aborted_at_close
        assert all(len(t.request.output) == 100 for t in tickets)
    else:
        assert set(loop.aborted_at_close) == ids and "aborted at shutdown" in caplog.text
    assert engine.cache.num_free_pages == engine.cache.num_pages - 1 and not loop.alive


def _hf_folder(path):
    """A tiny random Qwen2 and a byte-level BPE tokenizer with a chat template and an EOS, built here."""
    transformers = pytest.importorskip("transformers")
    from byte_tokenizer import write_byte_tokenizer

    vocab_size = write_byte_tokenizer(path)
    config = transformers.AutoConfig.for_model("qwen2", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return vocab_size - 1  # the EOS id


def test_a_model_directory_is_served_with_its_own_tokenizer_and_template(tmp_path):
    openai = pytest.importorskip("openai")
    from piecegraph.cli_common import load_model
    from piecegraph.server.run import BackgroundServer, build_state
    from piecegraph.server.tokenizer import HFTokenizer, load_tokenizer

    eos = _hf_folder(tmp_path)
    tok = load_tokenizer(str(tmp_path), 0)
    assert isinstance(tok, HFTokenizer) and tok.eos_ids == {eos}
    assert tok.decode(tok.encode("héllo 数")) == "héllo 数"
    prompt = tok.chat([("user", "hi")])
    assert tok.tok.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = load_model(str(tmp_path), "cpu", torch.float32, hf=True)
    config = EngineConfig(mode="eager", max_num_seqs=4, page_size=8, max_seq_len=128)
    want = Engine(model, config).generate([prompt], SamplingParams(max_new_tokens=12, eos_token_id=eos))[0]
    with BackgroundServer(build_state(Engine(model, config), tok, tmp_path.name)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        r = client.chat.completions.create(model=tmp_path.name, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == want
    assert r.choices[0].message.content == tok.decode(want)
    assert r.choices[0].finish_reason == ("stop" if want[-1] == eos else "length")


def test_serve_bench_url_drives_a_running_server(tmp_path):
    import json
    from collections import Counter

    from typer.testing import CliRunner

    from piecegraph.cli import app
    from piecegraph.serve.bench import Workload
    from piecegraph.server.run import BackgroundServer, build_state

    engine = Engine(Decoder.random(TINY, seed=2).eval(), EngineConfig(mode="eager", max_num_seqs=8, page_size=8,
                                                                      max_seq_len=64))
    out = tmp_path / "http.json"
    with BackgroundServer(build_state(engine, TOK, "tiny")) as server:
        result = CliRunner().invoke(app, ["serve-bench", "--url", server.url, "--concurrency", "1,4", "--requests",
                                          "6", "--device", "cpu", "--repeats", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["benchmark"] == "serve-bench" and data["env"]["url"] == server.url and data["env"]["model"] == "tiny"
    rows = data["rows"]
    assert all(r["mode"] == "http" for r in rows) and list(data["setup"]) == ["http"]
    assert [r["concurrency"] for r in rows] == [1, 4] and all(r["requests"] == 6 for r in rows)
    assert all(len(r["repeats_output_tok_s"]) == 2 for r in rows)  # the upper of two runs reported
    for row in rows:  # every token of the workload arrived (token ids in the events, ignore_eos honoured)
        work = Workload(32, 8, 0.25, 0).requests(6, TINY.vocab_size, salt=row["concurrency"])
        assert row["output_tokens"] == sum(n for _, n in work)
    # tokens a handler reads in one chunk share its time (a gap of 0), so on a loaded CPU the median gap can be 0
    assert all(r["ttft_p50_ms"] > 0 and r["itl_mean_ms"] > 0 for r in rows)
    # the server's engine, read from its /metrics around each run: its steps are the engine's (warm-up aside)
    shares = [r["server_engine"] for r in rows]
    assert 0 < sum(s["steps"] for s in shares) <= len(engine.steps)
    kinds = Counter(str(s.kind) for s in engine.steps)  # and by kind: each within what the engine ran
    assert all(sum(s["steps_by_kind"].values()) == s["steps"] for s in shares)
    assert all(sum(s["steps_by_kind"].get(k, 0) for s in shares) <= n for k, n in kinds.items())
    assert set().union(*(s["steps_by_kind"] for s in shares)) <= set(kinds)
    for share in shares:
        assert 0 < share["loop_share"]["step"] <= 1 and set(share["phase_ms_per_step"]) == set(PHASES)
        launched = sum(share["phase_ms_per_step"][p] for p in PHASES[:3]) * share["steps"] / 1e3
        assert share["loop_s"]["step"] >= 0.9 * launched, share  # the phases happen inside the loop's steps
    result = CliRunner().invoke(app, ["serve-bench", "--url", "http://127.0.0.1:9", "--device", "cpu"])
    assert result.exit_code == 1 and "failed" in result.output


def test_serve_command_help_and_import_stays_light():
    from typer.testing import CliRunner

    from piecegraph.cli import app

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0 and "--hf" in result.output
    code = ("import sys, piecegraph, piecegraph.cli\n"
            "print(any(m.startswith(('fastapi', 'uvicorn')) for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_a_server_shutting_down_answers_503_and_still_finishes_what_it_holds():
    import httpx

    from piecegraph.server.run import BackgroundServer, build_state

    engine = Engine(Decoder.random(TINY, seed=2).eval(), EngineConfig(mode="eager", max_num_seqs=2, page_size=8,
                                                                      max_seq_len=64))
    with BackgroundServer(build_state(engine, TOK, "tiny")) as server:
        server.state.loop.begin_close()
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "late"})
        assert r.status_code == 503 and r.headers["Retry-After"] and "shutting down" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 200


def _reference_chunk(head, chat, return_ids, text, ids, reason, role=False):
    """The chunk as a dict through json.dumps: what ChunkFormat must equal byte for byte."""
    import json

    choice = {"index": 0, "logprobs": None, "finish_reason": reason}
    if chat:
        delta = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    if return_ids:
        choice["token_ids"] = ids
    kind = "chat.completion.chunk" if chat else "text_completion"
    return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice]})}\n\n"


@pytest.mark.parametrize("seed", range(10))
def test_chunk_format_equals_json_dumps_of_the_chunk(seed):
    from piecegraph.server.sse import ChunkFormat

    rng = random.Random(seed)
    head = {"id": f"cmpl-{seed}", "created": 1700000000 + seed, "model": rng.choice(["tiny", 'we"ird\\né'])}
    for chat in (False, True):
        for return_ids in (False, True):
            fmt = ChunkFormat(head, chat, return_ids)
            if chat:
                assert fmt.chunk(None, [], None, role=True) == _reference_chunk(head, chat, return_ids, None, [],
                                                                                None, role=True)
            for _ in range(20):
                text = "".join(rng.choice(["a", "é", "数", "😀", '"', "\\", "\n", "\x00", "\t", "</"])
                               for _ in range(rng.randint(0, 6)))
                ids = [rng.randrange(1000) for _ in range(rng.randint(0, 4))]
                reason = rng.choice([None, "stop", "length", "abort"])
                assert fmt.chunk(text, ids, reason) == _reference_chunk(head, chat, return_ids, text, ids, reason)


def test_client_counts_token_ids_without_parsing_json():
    from piecegraph.serve.http_bench import _count_ids

    assert _count_ids(b'data: {"choices": [{"text": "a", "token_ids": [1, 22, 333]}]}') == 3
    assert _count_ids(b'data: {"choices":[{"text":"\\"token_ids\\": [9]","token_ids":[4,5]}]}') == 2  # vLLM's spacing
    assert _count_ids(b'data: {"choices": [{"text": "", "token_ids": []}]}') == 0
    assert _count_ids(b'data: {"choices": [{"text": "a", "token_ids": null}]}') is None
    assert _count_ids(b'data: {"choices": [{"text": "a"}]}') is None
    assert _count_ids(b'data: {"choices": [{"prompt_token_ids": [1, 2], "text": "a"}]}') is None


@pytest.mark.parametrize("flag, expected", [([], True), (["--cache"], True), (["--no-cache"], False)])
def test_serve_keeps_compiled_code_in_the_artifact_cache_unless_told_not_to(flag, expected, monkeypatch):
    from typer.testing import CliRunner

    from piecegraph.cli import app
    from piecegraph.server import run

    seen = {}

    def stop(factory, *args, **kwargs):  # the engine's config, as the engine process would get it
        seen["config"] = factory.args[-1]
        raise SystemExit(0)

    monkeypatch.setattr(run, "build_process_state", stop)
    result = CliRunner().invoke(app, ["serve", "--model", "tiny", "--device", "cpu", *flag])
    assert result.exit_code == 0, result.output
    assert seen["config"].cache_dir is expected
    assert (seen["config"].full_compile, seen["config"].share_trace) == ("auto", True)


def test_serve_full_compile_and_share_trace_reach_the_engine_and_a_wrong_value_is_refused(monkeypatch):
    from typer.testing import CliRunner

    from piecegraph.cli import app
    from piecegraph.server import run

    seen = {}

    def stop(factory, *args, **kwargs):
        seen["config"] = factory.args[-1]
        raise SystemExit(0)

    monkeypatch.setattr(run, "build_process_state", stop)
    result = CliRunner().invoke(app, ["serve", "--model", "tiny", "--device", "cpu", "--full-compile", "pieces",
                                      "--no-share-trace"])
    assert result.exit_code == 0 and seen["config"].full_compile == "pieces", result.output
    assert not seen["config"].share_trace
    shared = CliRunner().invoke(app, ["serve", "--model", "tiny", "--device", "cpu", "--full-compile", "whole"])
    assert shared.exit_code == 0 and seen["config"].share_trace, shared.output
    assert seen["config"].full_compile == "whole"
    wrong = CliRunner().invoke(app, ["serve", "--model", "tiny", "--device", "cpu", "--full-compile", "halves"])
    assert wrong.exit_code == 2 and "--full-compile" in wrong.output and "halves" in wrong.output, wrong.output


def test_serve_api_servers_reach_the_engine_process_and_bad_ones_are_refused(monkeypatch):
    """--api-servers N gives the engine process N front ends; with --engine-thread it is refused naming the
    option; a port already taken fails before the engine's start-up, naming --port."""
    import socket

    from typer.testing import CliRunner

    from piecegraph.cli import app
    from piecegraph.server import run

    seen = {}

    def stop(factory, *args, **kwargs):
        seen["frontends"] = kwargs["frontends"]
        raise SystemExit(0)

    monkeypatch.setattr(run, "build_process_state", stop)
    base = ["serve", "--model", "tiny", "--device", "cpu", "--port", "0"]
    result = CliRunner().invoke(app, [*base, "--api-servers", "3"])
    assert result.exit_code == 0, result.output
    assert seen["frontends"] == 3
    result = CliRunner().invoke(app, [*base])
    assert result.exit_code == 0 and seen["frontends"] == 1  # the default on CPU
    result = CliRunner().invoke(app, [*base, "--api-servers", "2", "--engine-thread"])
    assert result.exit_code != 0 and "--api-servers" in result.output and "engine-process" in result.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, [*base[:-1], str(port)])
    assert result.exit_code != 0 and "--port" in result.output and f"127.0.0.1:{port}" in result.output


def test_http_stack_names_the_missing_c_parts(monkeypatch):
    """`piecegraph serve` says when uvicorn would run on its pure-Python loop or parser, and how to get the C ones."""
    import importlib.machinery
    import importlib.util

    from piecegraph.server.run import http_stack

    # uvloop present, httptools missing (whatever this machine has: a spec object stands for an installed package)
    present = importlib.machinery.ModuleSpec("uvloop", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "httptools" else present)
    stack, hint = http_stack()
    assert stack == "uvloop + h11" and "httptools" in hint and "uvloop" not in hint and "[server]" in hint
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    stack, hint = http_stack()
    assert stack == "asyncio + h11" and "uvloop and httptools" in hint


def test_connections_the_server_accepts_send_without_nagle():
    """The server's listening socket is TCP by protocol number, so asyncio turns Nagle off on every connection it
    accepts. With the default protocol 0 it did not, and a keep-alive connection's next stream waited for the
    client's delayed ACK (its first token ~40 ms late on loopback)."""
    import socket

    from piecegraph.server.frontends import listening_socket

    async def accepted_nodelay() -> int:
        sock = listening_socket("127.0.0.1", 0, reuse_port=False)
        seen = asyncio.get_running_loop().create_future()

        async def on_client(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_client, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


@pytest.mark.parametrize("text, want", [
    ("# HELP vllm:num_requests_running x\nvllm:num_requests_running 3\n", None),  # not piecegraph's server
    ("piecegraph_queue_depth 0\n", {}),  # piecegraph's, no engine counters at this front end yet
    ('piecegraph_queue_depth 0\npiecegraph_engine_steps_total{kind="full"} 12\n'
     'piecegraph_engine_loop_seconds_total{part="step"} 0.5\n',
     {"piecegraph_engine_steps_total": {"full": 12.0}, "piecegraph_engine_loop_seconds_total": {"step": 0.5}}),
])
def test_engine_counters_tell_a_piecegraph_server_without_counters_from_another_server(monkeypatch, text, want):
    """A piecegraph front end that has not yet heard the engine's counters answers ``{}``, not ``None``: the
    benchmark settles and scrapes again instead of dropping the engine's shares for the whole run (a REPEATS=3
    HTTP run on the H200 lost them that way)."""
    import io
    import urllib.request

    from piecegraph.serve import http_bench

    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(text.encode()))
    assert http_bench.engine_counters("http://x") == want
    sleeps = []
    monkeypatch.setattr(http_bench.time, "sleep", sleeps.append)
    assert http_bench._settled_counters("http://x") == want
    assert sleeps == ([] if want is None else [http_bench.SETTLE_S])
