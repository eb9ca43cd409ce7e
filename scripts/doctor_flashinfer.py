"""A doctor target: a small bf16 model calling FlashInfer's rmsnorm, silu_and_mul and fp4_quantize.

`piecegraph doctor scripts/doctor_flashinfer.py:target --device cuda [--fix]` on a CUDA machine with FlashInfer;
`...:reference` is the reference decoder with FlashInfer attention on a paged KV cache (nothing should block).
fp4_quantize is left out where this FlashInfer refuses it on this GPU (0.7+ needs SM100 for it).
"""

import torch


class FlashInferBlock(torch.nn.Module):
    def __init__(self, hidden: int = 256, inter: int = 512, fp4: bool = True):
        super().__init__()
        self.fp4 = fp4
        self.norm = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)
        self.register_buffer("global_scale", torch.tensor([448.0 * 6.0 / 4.0]))

    def forward(self, x):
        import flashinfer

        h = flashinfer.norm.rmsnorm(x, self.norm)
        a = flashinfer.activation.silu_and_mul(self.up(h))
        if not self.fp4:
            return x + self.down(a)
        q, sf = flashinfer.fp4_quantize(a, self.global_scale)
        return x + self.down(a), q, sf


def fp4_runs_here() -> bool:
    from piecegraph.adapters.flashinfer import fp4_refusal

    refusal = fp4_refusal()
    if refusal:
        print(f"doctor_flashinfer: leaving fp4_quantize out: {refusal}")
    return refusal is None


def target():
    torch.manual_seed(0)
    model = FlashInferBlock(fp4=fp4_runs_here()).cuda().to(torch.bfloat16).eval()
    x = torch.randn(24, 256, device="cuda", dtype=torch.bfloat16)
    return model, (x,)


def reference():
    """The reference decoder (0.5B shape, 4 layers, bf16) on a paged cache with FlashInfer attention, a mixed step."""
    from piecegraph.attention import AttentionMetadata, KVCache
    from piecegraph.models import QWEN2_5_0_5B, Decoder

    config = QWEN2_5_0_5B.replace(num_layers=4, attention_backend="flashinfer")
    model = Decoder.random(config, seed=0, dtype=torch.bfloat16, device="cuda")
    cache = KVCache.for_sequences(config, 4, 256, dtype=torch.bfloat16, device="cuda")
    AttentionMetadata.for_batch(cache, [(0, 0, 20)])  # a cached prefix for the chunked continuation below
    meta = AttentionMetadata.for_batch(cache, [(0, 20, 12), (1, 0, 30), (2, 0, 1)])
    ids = torch.randint(0, config.vocab_size, (meta.num_tokens,), device="cuda")
    return {"model": model, "inputs": (ids, meta.positions), "context": meta}
