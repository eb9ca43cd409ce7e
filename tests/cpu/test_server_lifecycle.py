"""A server running on a tiny model: the engine loop's shutdown (finish or abort, pages freed), a model directory's
tokenizer through transformers served end to end (``--hf``), ``serve-bench --url`` driving a running server, 503
while shutting down, and accepted connections without Nagle."""

import asyncio

import pytest
import torch

from piecegraph.models import TINY, Decoder
from piecegraph.serve import Engine, EngineConfig, SamplingParams
from piecegraph.serve.stats import PHASES
from piecegraph.server.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = ByteTokenizer()


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
