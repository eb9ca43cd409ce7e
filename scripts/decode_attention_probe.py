"""FlashInfer's paged decode attention at Llama-3.2-1B's shape, and the KV write beside it, in CUDA graphs.

Usage: python scripts/decode_attention_probe.py [OUTDIR] [--context 256] [--batches 1,10]
Shape: 32 query / 8 KV heads of 64, pages of 16 tokens, 16 layers (each its own caches) captured in one CUDA graph
and replayed (CUDA events, median of 20 replays). Rows, per batch: the decode wrapper on tensor cores
and on the plain decode kernel, each planned in CUDA-graph mode (what a captured engine step runs) and in eager
mode (what a graph baked for one exact step runs); then the KV write of the step's new token in every layer as two
``index_copy_``, as Inductor's indexed assignment, and as piecegraph's one-kernel ``write_kv``. Prints the rows;
with OUTDIR, writes ``<date>_<gpu>_decode_attention_probe.json`` there.
"""

import argparse

import torch

from piecegraph.attention.backends.kv_write import write_kv
from piecegraph.graphs.capture import graph_ms
from piecegraph.results.schema import environment, result_name, write_result

HEADS, KV_HEADS, DIM, PAGE, LAYERS = 32, 8, 64, 16, 16


def graph_us(fn):
    """Median µs of one replay of ``fn`` captured alone in a CUDA graph (:func:`graph_ms`, 20 replays)."""
    return graph_ms(fn, (), repeats=20) * 1e3


def attention_rows(batch, context):
    import flashinfer

    pages_per_row = -(-context // PAGE)
    pages = batch * pages_per_row + 1
    caches = [[torch.randn(pages, PAGE, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
              for _ in range(LAYERS)]
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per_row
    indices = torch.arange(batch * pages_per_row, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), context - (pages_per_row - 1) * PAGE, dtype=torch.int32)
    rows = []
    for tensor_cores in (True, False):
        for graph_mode in (True, False):
            buffers = dict(use_cuda_graph=True, paged_kv_indptr_buffer=indptr.cuda(),
                           paged_kv_indices_buffer=indices.clone(),
                           paged_kv_last_page_len_buffer=last.cuda()) if graph_mode else {}
            workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores,
                                                                    **buffers)
            wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16,
                         kv_data_type=torch.bfloat16)
            us = graph_us(lambda w=wrapper: [w.run(q, tuple(c), out=out) for c in caches])
            rows.append(dict(batch=batch, context=context, what="decode attention", tensor_cores=tensor_cores,
                             cuda_graph_plan=graph_mode, us_16_layers=round(us, 1)))
    return rows


def kv_write_rows(batch):
    caches = [torch.zeros(batch * 64, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2 * LAYERS)]
    k = torch.randn(batch, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(batch, device="cuda") * PAGE

    def index_put(kcs, k, slots):
        for cache in kcs:
            cache[slots] = k

    compiled = torch.compile(index_put, fullgraph=True)
    variants = {
        "two index_copy_": lambda: [c.index_copy_(0, slots, k) for c in caches],
        "inductor index_put": lambda: compiled(caches, k, slots),
        "write_kv": lambda: [write_kv(k, k, caches[2 * i], caches[2 * i + 1], slots) for i in range(LAYERS)],
    }
    return [dict(batch=batch, what=f"kv write: {name}", us_16_layers=round(graph_us(fn), 1))
            for name, fn in variants.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", nargs="?")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batches", default="1,10")
    args = parser.parse_args()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        rows += attention_rows(batch, args.context) + kv_write_rows(batch)
    for row in rows:
        print(row)
    if args.outdir:
        env = environment(attention="flashinfer", model="llama-3.2-1b attention shape", dtype=torch.bfloat16,
                          quant=None)
        print("wrote", write_result(f"{args.outdir}/{result_name(env, 'decode_attention_probe')}",
                                    "decode-attention-probe", env, rows))


if __name__ == "__main__":
    main()
