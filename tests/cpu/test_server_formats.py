"""The server's text and wire formats without HTTP: incremental text equals whole decoding, stop strings and stop
ids, the byte tokenizer and its chat template, the Prometheus text, a request refused naming the field, each SSE
chunk equal to ``json.dumps`` of it, and what the HTTP benchmark client reads from a stream and from ``/metrics``."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.floats(min_value=0, max_value=1e7, allow_nan=False), min_size=1, max_size=5))
def test_counters_render_exactly_what_they_hold(parts):
    """A counter's text reads back as the float it holds, however large: two scrapes' difference is exact."""
    metrics = Metrics()
    for part in parts:
        metrics.inc("piecegraph_engine_time_to_first_token_seconds_total", part)
    line = next(line for line in metrics.render().splitlines()
                if line.startswith("piecegraph_engine_time_to_first_token_seconds_total"))
    assert float(line.rsplit(" ", 1)[1]) == metrics.value("piecegraph_engine_time_to_first_token_seconds_total")


def test_protocol_refuses_naming_the_field():
    with pytest.raises(APIError, match="^temperature") as err:
        parse(b'{"model": "m", "prompt": "x", "temperature": 3}', CompletionRequest)
    assert err.value.param == "temperature" and err.value.status == 400
    assert parse(b'{"model": "m", "prompt": [1, 2], "n": 1}', CompletionRequest).prompt == [1, 2]


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
