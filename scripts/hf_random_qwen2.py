"""Write a random-weight Hugging Face Qwen2ForCausalLM of the Qwen2.5-0.5B shape (bf16) into a folder.

Usage: python scripts/hf_random_qwen2.py OUTDIR [--layers N]. No download: the config is built here, the weights
drawn like ``Decoder.random`` (projections ~ N(0, 1/fan_in), so greedy tokens depend on the context). The same
folder benchmarks both paths on identical weights:

    piecegraph bench --model OUTDIR --hf ...   # the transformers model itself, through piecegraph.hf
    piecegraph bench --model OUTDIR ...        # the reference decoder (load_hf reads the same checkpoint)
"""

from __future__ import annotations

import argparse

import torch


def random_qwen2(layers: int = 24, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """The 0.5B-shaped ``Qwen2ForCausalLM`` (hidden 896, 14 heads over 2 kv heads, intermediate 4864, vocab
    151936, tied embeddings, theta 1e6) with random weights, in eval mode."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
                         rms_norm_eps=1e-6)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.05, generator=gen)
            elif name.endswith("proj.weight"):
                param.normal_(0.0, param.shape[1] ** -0.5, generator=gen)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    random_qwen2(args.layers).save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
