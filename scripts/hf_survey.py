"""Survey: which transformers causal-LM types piecegraph.hf runs with transformers' exact greedy tokens.

For every type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (or ``--types a,b,c``): a tiny random
config (hidden, layers, heads, intermediate sizes and vocabulary shrunk generically, special ids inside the
vocabulary), float32 on CPU, two fixed prompts; transformers' greedy ``generate`` (``do_sample=False``, EOS from
``generation_config``) against ``piecegraph.hf.generate`` (eager mode: the CPU default). Each type runs in its own
subprocess with a timeout (some hang), at most ``--jobs`` at a time. Verdicts:

- ``equal``: piecegraph's greedy tokens equal transformers';
- ``refused``: piecegraph refused the model (``UnsupportedModelError``, its message is the reason);
- ``wrong``: piecegraph ran it with other tokens (must never happen);
- ``error``: piecegraph failed otherwise, or the type ran past the timeout;
- ``skipped``: no tiny config or model of the type could be built here;
- ``transformers-fails``: transformers' own ``generate`` fails on the tiny model.

Usage::

    python scripts/hf_survey.py --json out.json             # every type, 2 at a time
    python scripts/hf_survey.py --types gpt2,opt,llama      # a few, printed
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11], [7, 7, 1, 64, 30]]
NEW_TOKENS = 8
MAX_PARAMS = 8e6
VOCAB = 128
# Tiny sizes by config field (a field the type's config lacks is not set; attribute_map aliases such as GPT-2's
# n_embd are reached through the canonical names).
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, sep_token_id=3,
             cls_token_id=1, n_inner=128, ffn_dim=128, ffn_hidden_size=128, rotary_dim=8, num_experts=4,
             num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
             topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=16, d_ff=128, num_layers=2, encoder_layers=2, decoder_layers=2,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128)
# Integer fields still large after SIZES, shrunk to this size when the model has more than MAX_PARAMS parameters.
SHRINK_WORDS = ("size", "dim", "rank", "hidden", "inner", "expert", "embed", "channels", "width")


# Per-type fields a generic shrink cannot guess (lists sized by the layer count).
OVERRIDES = {"gpt_neo": dict(attention_types=[[["global", "local"], 1]])}


def tiny_config(model_type: str):
    """The type's tiny config, or raise (the type is skipped). A field the config refuses to set (a read-only
    property) is left at its default."""
    import re

    import transformers

    default = transformers.CONFIG_MAPPING[model_type]()
    fields = {k: v for k, v in SIZES.items() if hasattr(default, k)}
    if getattr(default, "num_key_value_heads", None) == 1:
        fields.pop("num_key_value_heads", None)  # multi-query by design (GPT-BigCode, Falcon): keep one KV head
    if hasattr(default, "qk_rope_head_dim"):
        fields.pop("head_dim", None)  # multi-head latent attention: head_dim is the rotary part, set from it
        fields["num_key_value_heads"] = fields.get("num_attention_heads")  # and every head has its own keys
    if hasattr(default, "is_decoder"):
        fields["is_decoder"] = True  # BERT-like causal LMs attend causally only as decoders
    fields.update(OVERRIDES.get(model_type, {}))
    for _ in range(len(fields) + 1):
        try:
            return transformers.AutoConfig.for_model(model_type, **fields)
        except AttributeError as err:
            read_only = re.search(r"property '(\w+)' of '\w+' object has no setter", str(err))
            if not read_only or read_only.group(1) not in fields:
                raise
            fields.pop(read_only.group(1))
    raise ValueError("no tiny config")


def _shrunk(config):
    """``config`` with every other large integer size field set to 64 (a type with sizes of its own)."""
    import transformers

    # the sizes, and whether it decodes causally (a BERT-like type's tiny config sets is_decoder)
    fields = {k: v for k, v in config.to_dict().items() if k in SIZES or k == "is_decoder"}
    for key, value in config.to_dict().items():
        if (isinstance(value, int) and not isinstance(value, bool) and value > 128 and key not in SIZES
                and any(w in key for w in SHRINK_WORDS)):
            fields[key] = 64
    return transformers.AutoConfig.for_model(config.model_type, **fields)


def tiny_model(model_type: str):
    """A float32 tiny random causal LM of ``model_type``, weights drawn so that every layer matters."""
    import torch
    import transformers

    config = tiny_config(model_type)
    with torch.device("meta"):
        size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMS:
        config = _shrunk(config)
        with torch.device("meta"):
            size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMS:
            raise ValueError(f"its tiny config still has {size / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if getattr(model.config, "_experts_implementation", None) == "eager":
        model.config._experts_implementation = "batched_mm"  # as piecegraph.hf.load: eager experts do not trace
    gemma = "gemma" in model_type
    with torch.no_grad():  # ~N(0, 1/fan_in) projections: greedy tokens depend on the context, not on the bias
        for name, param in model.named_parameters():
            if "embed" in name or "wte" in name or "wpe" in name:
                param.normal_(0, 0.02 if gemma else 0.1)
            elif param.dim() >= 2 and "norm" not in name:
                param.normal_(0, param.shape[-1] ** -0.5)
    return model


def survey_one(model_type: str) -> dict:
    """One type's row (see the module docstring), run in this process."""
    import torch

    import piecegraph.hf as pghf

    torch.set_num_threads(1)
    start = time.perf_counter()

    def row(verdict: str, reason: str = "") -> dict:
        first = (reason.strip().splitlines() or [""])[0][:400]
        return {"type": model_type, "verdict": verdict, "reason": first,
                "seconds": round(time.perf_counter() - start, 2)}

    try:
        model = tiny_model(model_type)
    except Exception as err:  # noqa: BLE001  (a type this harness cannot build tiny: not piecegraph's concern)
        return row("skipped", f"{type(err).__name__}: {err}")
    try:
        expected = []
        with torch.no_grad():
            for prompt in PROMPTS:
                out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                     dtype=torch.long), max_new_tokens=NEW_TOKENS, do_sample=False)
                expected.append(out[0, len(prompt):].tolist())
    except Exception as err:  # noqa: BLE001
        return row("transformers-fails", f"{type(err).__name__}: {err}")
    try:
        pghf.check_supported(model.config)
        got = pghf.generate(model, PROMPTS, NEW_TOKENS, mode="eager", backend="torch", reuse=False)
    except (pghf.UnsupportedModelError, TypeError) as err:
        if isinstance(err, TypeError) and "ForCausalLM" not in str(err):
            return row("error", f"{type(err).__name__}: {err}")
        return row("refused", str(err))
    except Exception as err:  # noqa: BLE001
        return row("error", f"{type(err).__name__}: {err}")
    eos = pghf.eos_ids(pghf.wrap(model, verify=False))
    pghf.unwrap(model)
    cut = [t[: next((i + 1 for i, x in enumerate(t) if x in eos), len(t))] for t in expected]
    if got == cut:
        return row("equal")
    return row("wrong", f"transformers {cut}, piecegraph {got}")


def _in_subprocess(model_type: str, timeout: float) -> dict:
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--one", model_type]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"type": model_type, "verdict": "error", "reason": f"timed out after {timeout:.0f} s",
                "seconds": round(time.perf_counter() - start, 2)}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"type": model_type, "verdict": "error", "reason": f"exit {out.returncode}: {tail[:300]}",
            "seconds": round(time.perf_counter() - start, 2)}


def refusal_groups(rows: list[dict]) -> dict[str, list[str]]:
    """Refused types grouped by their reason, its model type, numbers and details cut off."""
    import re

    groups: dict[str, list[str]] = {}
    for row in rows:
        if row["verdict"] == "refused":
            reason = re.sub(r"model_type '[^']+': ", "", row["reason"])
            reason = re.sub(r"\([^)]*\)|\[[^\]]*\]", "", reason)
            reason = re.split(r"[;:]", re.sub(r"\d+", "N", reason))[0].strip()
            groups.setdefault(reason, []).append(row["type"])
    return groups


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: every causal-LM type)")
    parser.add_argument("--json", type=Path, help="write the rows here in piecegraph's result schema")
    parser.add_argument("--jobs", type=int, default=2, help="types surveyed at once (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per type (default 300)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one type in this process: print its row as JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(survey_one(args.one)), flush=True)
        return 0
    types = args.types.split(",") if args.types else all_types()
    rows = []
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for row in pool.map(lambda t: _in_subprocess(t, args.timeout), types):
            rows.append(row)
            print(f"{row['type']:28s} {row['verdict']:18s} {row['seconds']:7.1f}s  {row['reason'][:150]}", flush=True)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    print("counts:", json.dumps(counts, sort_keys=True))
    for reason, names in sorted(refusal_groups(rows).items(), key=lambda kv: -len(kv[1])):
        print(f"{len(names):3d} refused: {reason}: {', '.join(names)}")
    if args.json:
        import transformers

        from piecegraph.results.schema import environment, write_result

        env = environment(attention="torch", model=None, dtype="float32", quant=None, gpu="cpu",
                          transformers=transformers.__version__)
        write_result(args.json, "hf-survey", env, rows, counts=counts, new_tokens=NEW_TOKENS, prompts=PROMPTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
