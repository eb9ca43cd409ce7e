"""What the serving engine's CPU tests share: the prompts and their greedy reference (the module-scoped fixtures
``model`` and ``expected``: a test module imports them to use them), an engine config whose small sizes meet every
dispatch case, and ``Arithmetic``, a flat-token model whose next token is known in closed form."""

import random

import pytest
import torch

from piecegraph.models import TINY, Decoder, generate
from piecegraph.models.config import ModelConfig
from piecegraph.serve import EngineConfig

MAX_NEW = 8
PAGE_SIZE = 4
MAX_SEQ_LEN = 48


def random_prompts(n, seed=0, longest=30):
    """``n`` prompts of 1 to ``longest`` random TINY token ids, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(TINY.vocab_size) for _ in range(rng.randint(1, longest))] for _ in range(n)]


PROMPTS = random_prompts(7)


@pytest.fixture(scope="module")
def model():
    return Decoder.random(TINY, seed=3).eval()


@pytest.fixture(scope="module")
def expected(model):
    """Each prompt alone, eager greedy decoding, its own fresh cache: the independent reference."""
    return [generate(model, [p], MAX_NEW)[0] for p in PROMPTS]


def small_engine_config(mode, **changes):
    """An emulated-graph, eager-compiler ``EngineConfig`` for ``mode``, with ``changes`` applied."""
    # Small sizes, so that the dispatch meets every case: decode batches above the full sizes go piecewise,
    # prefill steps above the piecewise sizes run without graphs.
    base = dict(mode=mode, max_num_seqs=4, max_num_batched_tokens=16, page_size=PAGE_SIZE, max_seq_len=MAX_SEQ_LEN,
                decode_sizes=(1, 2), prefill_sizes=(1, 2, 4, 8), compiler="eager", emulate_graphs=True)
    return EngineConfig(**{**base, **changes})


class Arithmetic(torch.nn.Module):
    """A flat-token "model": the next token after ``t`` at position ``p`` is ``(31 t + 7 p + 1) % V``; its
    outputs depend on nothing else, so any scheduling (chunks, batches, preemption) must give the same tokens."""

    V = 97
    config = ModelConfig(vocab_size=V, hidden_size=2, intermediate_size=2, num_layers=1, num_heads=1,
                         num_kv_heads=1, head_dim=2, max_seq_len=64, attention_backend="torch")

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # device and dtype for the engine's cache

    def forward(self, input_ids, positions):
        return torch.stack([input_ids, positions], -1)

    def logits(self, hidden):
        nxt = (31 * hidden[:, 0] + 7 * hidden[:, 1] + 1) % self.V
        return torch.nn.functional.one_hot(nxt, self.V).float()

    @classmethod
    def expect(cls, prompt, n):
        tokens = list(prompt)
        for _ in range(n):
            tokens.append((31 * tokens[-1] + 7 * (len(tokens) - 1) + 1) % cls.V)
        return tokens[len(prompt):]
