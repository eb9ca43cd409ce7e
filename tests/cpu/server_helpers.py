"""What the OpenAI-compatible server's CPU tests share: the server's optional dependencies (a test module that
imports this one is skipped without them; ``httpx`` is re-exported), the byte tokenizer, text prompts, an
``openai`` client on loopback, one completion read streaming or not, and waits for the engine's pages to come
back."""

import random
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from piecegraph.server.tokenizer import ByteTokenizer  # noqa: E402

MAX_SEQ_LEN = 128
NEW = 10
TOK = ByteTokenizer()


def openai_client(url):
    """The official client on ``url``: no retries, so a refusal reaches the test as it is."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def text_prompts(n, seed):
    """``n`` prompts of 1 to 8 words, multi-byte characters and whitespace among them, the same for the same seed."""
    rng = random.Random(seed)
    words = ["piece", "graph", "cuda", "été", "数据", "token", " ", "\n", "λ"]
    return ["".join(rng.choice(words) for _ in range(rng.randint(1, 8))) for _ in range(n)]


def all_pages_free(engine):
    return engine.cache.num_free_pages == engine.cache.num_pages - 1


def wait_all_pages_free(engine, timeout=10.0):
    """Whether every page of ``engine`` came back within ``timeout`` seconds (the loop frees them asynchronously)."""
    deadline = time.monotonic() + timeout
    while not all_pages_free(engine) and time.monotonic() < deadline:
        time.sleep(0.02)
    return all_pages_free(engine)


def completion(url, prompt, stream):
    """One greedy completion of ``NEW`` tokens: ``(text, token ids, finish reason)``, streamed or not."""
    client = openai_client(url)
    if not stream:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0,
                                      extra_body={"return_token_ids": True})
        choice = r.choices[0]
        assert r.usage.completion_tokens == len(choice.token_ids)
        return choice.text, choice.token_ids, choice.finish_reason
    text, ids, reason = "", [], None
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0, stream=True,
                                           extra_body={"return_token_ids": True}):
        for choice in chunk.choices:
            text += choice.text
            ids += choice.token_ids
            reason = choice.finish_reason or reason
    return text, ids, reason
