"""The one-kernel KV write on a GPU: inside a captured CUDA graph, replayed with new keys, values and slots, it
writes exactly what two ``index_copy_`` calls write, at the shapes served (Llama-3.2-1B's 8 KV heads of 64, the
0.5B shape's 2 of 64, 16 of 128) and as a fused QKV output's slices."""

import pytest
import torch

from piecegraph.attention.backends import kv_write

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kv_heads, dim", [(8, 64), (2, 64), (16, 128)])
@pytest.mark.parametrize("rows", [1, 10, 256])
def test_a_captured_write_replays_as_index_copy(rows, kv_heads, dim):
    pytest.importorskip("triton")
    slots_total, gen = 4096, torch.Generator(device="cuda").manual_seed(rows)
    qkv = torch.empty(rows, (4 * kv_heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16)
    k = qkv[:, 4 * kv_heads * dim: 5 * kv_heads * dim].view(rows, kv_heads, dim)
    v = qkv[:, 5 * kv_heads * dim:].view(rows, kv_heads, dim)
    slots = torch.zeros(rows, dtype=torch.int64, device="cuda")
    caches = [torch.zeros(slots_total, kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    assert kv_write.fused_write_runs(k, v, *caches)
    kv_write.write_kv(k, v, *caches, slots)  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv_write.write_kv(k, v, *caches, slots)
    for _ in range(3):
        qkv.copy_(torch.randn(qkv.shape, device="cuda", generator=gen))
        slots.copy_(torch.randperm(slots_total, device="cuda", generator=gen)[:rows])
        want = [c.clone() for c in caches]
        want[0].index_copy_(0, slots, k)
        want[1].index_copy_(0, slots, v)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(got, w) for got, w in zip(caches, want))
