"""One rank of the CPU tensor-parallel check (started by tests/cpu/test_tp.py, torchrun-style env, gloo).

Every rank computes the TP=1 reference itself (the same seeded weights), then shards a fresh copy with
``apply_tp`` and runs each variant; it writes ``{variant: {"rel": ..., "tokens_equal": ..., ...}}`` as JSON to
``argv[1]``. Usage: ``RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python tp_worker.py out.json``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import piecegraph
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.models import TINY, Decoder, generate
from piecegraph.parallel import ALL_REDUCE_INPLACE, apply_tp, register_group

PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1], [200, 13, 54, 2, 8, 31, 77]]  # 15 tokens: pads to 16
NEW_TOKENS = 8
CONFIGS = {
    # 4 q / 2 kv heads: one kv head per rank; tied embeddings, qkv bias.
    "tiny": TINY.replace(attention_backend="torch"),
    # 1 kv head (replicated on both ranks), untied lm_head, an odd vocabulary (uneven vocab slices).
    "mqa_untied": TINY.replace(num_kv_heads=1, tie_embeddings=False, vocab_size=257, attention_backend="torch"),
}
PIECEWISE = dict(mode="piecewise", capture_sizes=(4, 16), emulate_graphs=True)
FULL = dict(mode="full", capture_sizes=(4,), emulate_graphs=True)
SPLIT = dict(split_ops=[ALL_REDUCE_INPLACE])
# name -> (inplace all-reduce, compile kwargs (None: the plain sharded module), decode kwargs (None: the same))
VARIANTS = {
    "eager": (False, None, None),
    "none_inside": (False, dict(mode="none"), None),
    "none_split": (True, dict(mode="none", **SPLIT), None),
    "piecewise_inside": (False, PIECEWISE, None),
    "piecewise_split": (True, dict(PIECEWISE, **SPLIT), None),
    # Piecewise prefill, pure decode steps as one (emulated) full graph with every all-reduce inside it.
    "full_decode_inside": (False, PIECEWISE, FULL),
    "full_decode_split": (True, dict(PIECEWISE, **SPLIT), dict(FULL, **SPLIT)),
}


def _prefill_logits(model, fn) -> torch.Tensor:
    cache = KVCache.for_sequences(model.config, len(PROMPTS), 32, page_size=4)
    meta = AttentionMetadata.for_batch(cache, [(i, 0, len(p)) for i, p in enumerate(PROMPTS)])
    ids = torch.tensor([t for p in PROMPTS for t in p])
    with piecegraph.forward_context(meta), torch.inference_mode():
        hidden = fn(ids, meta.positions)[: len(ids)]
        return model.logits(hidden)


HF_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256)
HF_ARCHS = {"llama": dict(tie_word_embeddings=False, attention_bias=True),  # o_proj bias: added after the reduce
            "qwen2": dict(tie_word_embeddings=True, num_key_value_heads=1)}
HF_VARIANTS = ("eager", "none_inside", "none_split", "piecewise_inside", "piecewise_split", "full_decode_split")


def _tiny_hf(model_type: str):
    import transformers

    from piecegraph.hf import HFDecoder

    config = transformers.AutoConfig.for_model(model_type, **{**HF_BASE, **HF_ARCHS[model_type]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # as tests/cpu/test_hf.py: projections ~ N(0, 1/fan_in), so tokens depend on context
        for name, param in model.named_parameters():
            if "proj" in name and param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
            elif "embed" in name:
                param.normal_(0, 0.1)
    return HFDecoder(model, attention_backend="torch")


def _variant(model, kwargs, decode_kwargs, ref_logits, ref_tokens) -> dict:
    """One sharded ``model`` run as a variant says (eager, or compiled prefill and decode modules), against the
    unsharded reference's prefill logits and greedy tokens; with the compiled modules' stats."""
    fn = model if kwargs is None else piecegraph.compile(model, compiler="eager", **kwargs)
    decode = fn if decode_kwargs is None else piecegraph.compile(model, compiler="eager", **decode_kwargs)
    logits = _prefill_logits(model, fn)
    tokens = generate(model, PROMPTS, NEW_TOKENS, prefill_fn=fn, decode_fn=decode)
    entry = {"rel": ((logits - ref_logits).norm() / ref_logits.norm()).item(),
             "tokens_equal": tokens == ref_tokens, "tokens": tokens, "ref_tokens": ref_tokens,
             "kv_heads_per_rank": model.config.num_kv_heads,
             "cache_kv_heads": KVCache.for_sequences(model.config, 1, 8).num_kv_heads}
    for key, graphed in (("prefill", fn if kwargs else None), ("decode", decode if decode_kwargs else None)):
        if graphed is not None:
            stats = graphed.stats()
            entry[key] = {k: stats.get(k) for k in ("pieces", "split_ops", "sizes", "fallbacks", "replays")}
    return entry


def _hf_results() -> dict:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {}
    results = {}
    for arch in HF_ARCHS:
        ref = _tiny_hf(arch)
        ref_logits = _prefill_logits(ref, ref)
        ref_tokens = generate(ref, PROMPTS, NEW_TOKENS)
        for vname in HF_VARIANTS:
            inplace, kwargs, decode_kwargs = VARIANTS[vname]
            model = apply_tp(_tiny_hf(arch), "tp", inplace=inplace)
            results[f"hf_{arch}/{vname}"] = _variant(model, kwargs, decode_kwargs, ref_logits, ref_tokens)
    return results


def _engine_results() -> dict:
    """The serving engine on the sharded decoder (auto: emulated full decode graphs, piecewise otherwise), with
    a page budget small enough to preempt, against TP=1 greedy decoding."""
    from piecegraph.serve import Engine, EngineConfig, SamplingParams

    ref = Decoder.random(CONFIGS["tiny"], seed=3)
    ref_tokens = generate(ref, PROMPTS, NEW_TOKENS)
    model = apply_tp(Decoder.random(CONFIGS["tiny"], seed=3), "tp")
    config = EngineConfig(mode="auto", max_num_seqs=3, max_num_batched_tokens=8, num_pages=7, page_size=4,
                          max_seq_len=32, compiler="eager", emulate_graphs=True)
    engine = Engine(model, config)
    tokens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    stats = engine.stats()
    return {"tiny/engine_auto": {"tokens_equal": tokens == ref_tokens, "tokens": tokens, "ref_tokens": ref_tokens,
                                 "by_kind": stats["by_kind"], "preemptions": stats["preemptions"]}}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    register_group("tp")
    results = {}
    for cname, config in CONFIGS.items():
        ref = Decoder.random(config, seed=3)
        ref_logits = _prefill_logits(ref, ref)
        ref_tokens = generate(ref, PROMPTS, NEW_TOKENS)
        for vname, (inplace, kwargs, decode_kwargs) in VARIANTS.items():
            model = apply_tp(Decoder.random(config, seed=3), "tp", inplace=inplace)
            results[f"{cname}/{vname}"] = _variant(model, kwargs, decode_kwargs, ref_logits, ref_tokens)
    results.update(_engine_results())
    results.update(_hf_results())
    try:
        apply_tp(Decoder.random(TINY.replace(num_heads=3, num_kv_heads=1)), "tp")
        results["refuses_odd_heads"] = ""
    except ValueError as e:
        results["refuses_odd_heads"] = str(e)
    dist.barrier()
    dist.destroy_process_group()
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
