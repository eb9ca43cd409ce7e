"""FlashInfer's MLA kernel (``BatchMLAPagedAttentionWrapper``) behind the ``mla_attention`` split op, against the
torch MLA backend in bf16: decode, prefill and mixed steps over shuffled pages (DeepSeek's latent dims 512 / 64);
two MLA layers through piecegraph's piecewise and full graphs; DSA layers on the torch path (with a warning);
values of another width than keys (DeepSeek-V2 run expanded) through the FlashInfer prefill wrappers."""

import random
import sys
import warnings
from dataclasses import dataclass

import pytest
import torch

import piecegraph
import piecegraph.attention.mla_op  # noqa: F401  (registers torch.ops.piecegraph_models.mla_attention)
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.attention.backends import flashinfer_mla_available

BF16, DEVICE = torch.bfloat16, "cuda"
H, R, P, HI, DI = 16, 512, 64, 4, 128
SCALE = 192 ** -0.5  # DeepSeek's query/key head (128 + 64)


@dataclass(frozen=True)
class Shape:
    num_layers: int = 2
    num_heads: int = H
    num_kv_heads: int = 1
    head_dim: int = R
    v_head_dim: int = P
    index_head_dim: int = 0
    max_seq_len: int = 256
    attention_backend: str = "auto"
    mla: bool = True


_WHY = flashinfer_mla_available(torch.device("cuda"), BF16, Shape()) if torch.cuda.is_available() else "needs CUDA"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]
RESULTS = f"mla_flashinfer_{getattr(sys.modules.get('flashinfer'), '__version__', 'none')}.json"


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _twins(shape, num_pages=96, seed=0):
    """A torch-backend and a flashinfer-backend cache with equal random contents and equally shuffled pages."""
    caches = [KVCache(shape, num_pages, dtype=BF16, device=DEVICE, backend=b) for b in ("torch", "flashinfer")]
    assert [c.backend.__class__.__name__ for c in caches] == ["TorchMLABackend", "FlashInferMLABackend"]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    for t in (*caches[0].k, *caches[0].v, *caches[0].index_k):
        t.normal_(generator=gen)
    for src, dst in zip((*caches[0].k, *caches[0].v, *caches[0].index_k), (*caches[1].k, *caches[1].v,
                                                                           *caches[1].index_k)):
        dst.copy_(src)
    for cache in caches:
        random.Random(seed).shuffle(cache._free)
    return caches


def _inputs(n, seed, layers=2):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=BF16)

    return [dict(q_nope=rand(n, H, R) / 4, q_pe=rand(n, H, P), ckv=rand(n, R), kpe=rand(n, P),
                 index_q=rand(n, HI, DI), index_weights=rand(n, HI).float(), index_k=rand(n, DI))
            for _ in range(layers)]


def _attend(meta, inputs, topk=0, pad=3):
    """The op for each layer (DSA: layer 0 selects, layer 1 reuses), with ``pad`` garbage rows the op zeroes."""
    outs = []
    with torch.no_grad(), piecegraph.forward_context(meta):
        for layer, x in enumerate(inputs):
            rows = {k: torch.cat([v, torch.randn_like(v[:pad])]) for k, v in x.items()}
            index = {} if not topk or layer else dict(index_q=rows["index_q"], index_weights=rows["index_weights"],
                                                      index_k=rows["index_k"], index_scale=DI ** -0.5)
            outs.append(torch.full_like(rows["q_nope"], 7.0))
            torch.ops.piecegraph_models.mla_attention(rows["q_nope"], rows["q_pe"], rows["ckv"], rows["kpe"],
                                                      outs[-1], layer, SCALE, topk, **index)
    return torch.stack(outs)


CASES = {  # (prefixes already in the cache, the step's (seq, num_cached, num_new) rows)
    "decode": ([(0, 37), (1, 5), (2, 16), (3, 1), (4, 100)],
               [(0, 37, 1), (1, 5, 1), (2, 16, 1), (3, 1, 1), (4, 100, 1)]),
    "prefill": ([], [(0, 0, 37), (1, 0, 5), (2, 0, 16), (3, 0, 70), (4, 0, 1)]),
    "mixed": ([("d1", 12), ("d2", 40), ("c", 20)], [("p", 0, 23), ("d1", 12, 1), ("d2", 40, 1), ("c", 20, 19)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flashinfer_mla_equals_torch_mla(case, record_result):
    prefixes, seqs = CASES[case]
    caches = _twins(Shape(), seed=1)
    metas = []
    for cache in caches:
        cache.reserve(prefixes)
        metas.append(AttentionMetadata.for_batch(cache, seqs))
    n = metas[0].num_tokens
    inputs = _inputs(n, seed=2)
    expected, got = (_attend(m, inputs) for m in metas)
    err = max(_rel(g[:n], e[:n]) for g, e in zip(got, expected))
    record_result(RESULTS, f"mla_op_{case}", {"tokens": n, "rel_err_vs_torch": err})
    assert err < 2e-2, err
    assert torch.equal(got[:, n:], torch.zeros_like(got[:, n:]))
    for layer in range(2):  # the latents landed in the same slots, bit for bit
        assert torch.equal(caches[0].k[layer], caches[1].k[layer])
        assert torch.equal(caches[0].v[layer], caches[1].v[layer])


def test_dsa_layers_run_the_torch_path_with_a_warning(record_result):
    shape = Shape(index_head_dim=DI)
    caches = _twins(shape, seed=4)
    prefixes, seqs = CASES["mixed"]
    metas = []
    for cache in caches:
        cache.reserve(prefixes)
        metas.append(AttentionMetadata.for_batch(cache, seqs))
    inputs = _inputs(metas[0].num_tokens, seed=5)
    expected = _attend(metas[0], inputs, topk=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _attend(metas[1], inputs, topk=8)
    assert any("torch gather path" in str(w.message) for w in caught)
    assert torch.equal(got, expected)  # the same torch code on the same data


class TwoMLALayers(torch.nn.Module):
    """Projections around two mla_attention calls: what a graph captures around the split op."""

    def __init__(self, hidden=256):
        super().__init__()
        self.inp = torch.nn.ModuleList(torch.nn.Linear(hidden, H * (R + P) + R + P, bias=False) for _ in range(2))
        self.out = torch.nn.ModuleList(torch.nn.Linear(H * R, hidden, bias=False) for _ in range(2))

    def forward(self, x, positions):
        tokens = x.shape[0]
        for layer in range(2):
            qn, qp, ckv, kpe = self.inp[layer](x).split([H * R, H * P, R, P], dim=-1)
            o = torch.empty(tokens, H, R, dtype=x.dtype, device=x.device)
            torch.ops.piecegraph_models.mla_attention(qn.reshape(tokens, H, R), qp.reshape(tokens, H, P), ckv, kpe,
                                                      o, layer, SCALE)
            x = x + self.out[layer](o.view(tokens, H * R))
        return x


PREFIXES = [("d1", 12), ("d2", 40), ("c", 20), ("e", 7)]
MIXED = [("p", 0, 23), ("d1", 12, 1), ("d2", 40, 1), ("c", 20, 19)]
DECODE = [("p", 23), ("d1", 13), ("d2", 41), ("c", 39), ("e", 7)]
STEPS = [MIXED] + [[(s, c + i, 1) for s, c in DECODE] for i in range(3)]


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_two_mla_layers_through_piecegraph_graphs_equal_torch_eager(mode, record_result):
    torch.manual_seed(0)
    model = TwoMLALayers().to(DEVICE, BF16).eval()
    sizes = (4, 8) if mode == "full" else (8, 64)  # full: 5 decode rows in a size-8 graph, 3 pad rows
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=sizes)
    ref_cache, cache = _twins(Shape(), seed=3)
    for c in (ref_cache, cache):
        c.reserve(PREFIXES)
    errors = []
    for i, seqs in enumerate(STEPS):
        gen = torch.Generator(device=DEVICE).manual_seed(10 + i)
        n = sum(new for _, _, new in seqs)
        x = torch.randn(n, 256, generator=gen, device=DEVICE, dtype=BF16)
        ref_meta, meta = AttentionMetadata.for_batch(ref_cache, seqs), AttentionMetadata.for_batch(cache, seqs)
        fn = model if mode == "full" and i == 0 else graphed  # full graphs are decode only
        with torch.no_grad():
            with piecegraph.forward_context(ref_meta):
                expected = model(x, ref_meta.positions)
            with piecegraph.forward_context(meta):
                got = fn(x, meta.positions)
        errors.append(_rel(got, expected))
    stats = graphed.stats()
    record_result(RESULTS, f"mla_layers_{mode}", {"rel_err_per_step": errors, "replays": stats["replays"],
                                                  "replans": cache.backend.replans})
    assert max(errors) < 2e-2, errors
    assert stats["replays"] >= 2


def test_values_of_another_width_through_flashinfer_prefill_wrappers(record_result):
    """DeepSeek-V2 run expanded: keys 192, values 128 per head; FlashInfer's decode steps too (on a prefill
    wrapper, its decode wrapper having no head_dim_vo), eager and in a full-graph decode step."""
    from piecegraph.hf.arch import HFCacheShape
    from piecegraph.models import ModelConfig

    shape = HFCacheShape(vocab_size=64, hidden_size=256, intermediate_size=256, num_layers=1, num_heads=8,
                         num_kv_heads=8, head_dim=192, v_head_dim=128, max_seq_len=256)
    assert isinstance(shape, ModelConfig)
    caches = [KVCache(shape, 64, dtype=BF16, device=DEVICE, backend=b) for b in ("torch", "flashinfer")]
    errors = []
    for seqs in ([("p", 0, 23), ("c", 0, 19)], [("p", 23, 1), ("c", 19, 1)]):
        metas = [AttentionMetadata.for_batch(c, seqs) for c in caches]
        n = metas[0].num_tokens
        gen = torch.Generator(device=DEVICE).manual_seed(n)
        q, k = (torch.randn(n, 8 * 192, generator=gen, device=DEVICE, dtype=BF16) for _ in range(2))
        v = torch.randn(n, 8 * 128, generator=gen, device=DEVICE, dtype=BF16)
        outs = []
        for meta in metas:
            if meta.is_decode and meta.cache is caches[1]:
                meta = meta.for_cuda_graph(4)  # the graph wrapper's plan, run eagerly here
                q, k, v = (torch.cat([t, torch.zeros_like(t[:4 - n])]) for t in (q, k, v))
            out = torch.empty(q.shape[0], 8 * 128, device=DEVICE, dtype=BF16)
            with torch.no_grad(), piecegraph.forward_context(meta):
                torch.ops.piecegraph_models.attention(q, k, v, out, 0)
            outs.append(out[:n])
        errors.append(_rel(outs[1], outs[0]))
    record_result(RESULTS, "value_width_192_128", {"rel_err_vs_torch": errors})
    assert max(errors) < 2e-2, errors
