"""The fault soak (tests/cpu/test_serve_soak.py) on a GPU: real CUDA graphs, Inductor's pieces, the overlapped
and the synchronous loop. Seeded requests with random lengths, EOS stops, aborts, invalid requests interleaved and
a page budget that preempts; every valid request's float32 tokens (torch attention) equal its greedy tokens run
alone in eager, every page is free at the end, nothing escapes the step loop."""

import sys
from pathlib import Path

import pytest
import torch

from piecegraph.attention import KVCache
from piecegraph.models import TINY, Decoder, generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
import test_serve_soak as cpu_soak  # noqa: E402  (the soak's workload and checks, shared with the CPU run)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return Decoder.random(TINY, seed=3, device="cuda").eval()


@pytest.fixture(scope="module")
def pool(model):
    def alone(prompt):
        cache = KVCache.for_sequences(TINY, 1, len(prompt) + cpu_soak.MAX_NEW, dtype=torch.float32, device="cuda",
                                      backend="torch")
        return generate(model, [prompt], cpu_soak.MAX_NEW, cache=cache)[0]

    return cpu_soak.prompt_pool(alone)


@pytest.mark.parametrize(("overlap", "seed", "n_requests"), [(True, 0, 2000), (False, 2, 600)])
def test_fault_soak_on_cuda(model, pool, overlap, seed, n_requests, record_result):
    engine = cpu_soak._engine(model, overlap, compiler="inductor", emulate_graphs=False, attention_backend="torch")
    assert engine.device.type == "cuda"
    cpu_soak.check_soak(engine, n_requests, *cpu_soak.soak(engine, pool, n_requests, seed))
    stats = engine.stats()
    record_result("serve_soak_gpu.json", f"{'overlap' if overlap else 'sync'}-{n_requests}",
                  {"steps": stats["steps"], "by_kind": stats["by_kind"], "preemptions": stats["preemptions"],
                   "aborted": stats["aborted"]})
