"""Are a token check's divergences bf16 near-ties? Judged on any machine (CPU is fine) after the GPU run.

    python scripts/judge_divergences.py REFERENCE.json CHECK.json [CHECK.json ...] [--json OUT]

REFERENCE.json: ``scripts/http_token_check.py --reference``'s file (the prompts and the in-process engine's
tokens); CHECK.json: that script's ``--json`` (which requests differ, from which position). The preset (random,
seed 0: the same weights on every device) is rebuilt in bfloat16 and run in float32 with the torch attention
backend, a reference more precise than either side. At each first divergence it reports how many bf16 steps
separate the engine's token from the reference's runner-up (and from the server's token when the check recorded
it): a gap of about one step or less means kernels equal up to rounding may pick either token, so a batch of
another composition (the server's) can flip it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
from bf16_ties import bf16_steps  # noqa: E402  (the judge the GPU tests use)


def _logits_of(model, config):
    from piecegraph.attention import AttentionMetadata, KVCache
    from piecegraph.context import forward_context

    def logits(ids: list[int]) -> torch.Tensor:
        cache = KVCache.for_sequences(config, 1, len(ids) + 1, dtype=torch.float32, device="cpu", backend="torch")
        meta = AttentionMetadata.for_batch(cache, [(0, 0, len(ids))])
        with forward_context(meta), torch.no_grad():
            hidden = model(torch.tensor(ids), meta.positions)
            return model.logits(hidden[-1:])[0].float()
    return logits


def judge(reference: dict, check: dict, logits_of) -> list[dict]:
    """One row per divergence of ``check``: the position, the engine's token, the reference's top two there and
    the bf16 steps between the engine's token and the runner-up (and the server's token, when recorded)."""
    rows = []
    for entry in check["differ"]:
        i, at = entry["request"], entry["position"]
        prompt, engine = reference["prompts"][i], reference["tokens"][i]
        if at >= len(engine):
            rows.append({"request": i, "position": at, "note": "lengths differ, no token to judge"})
            continue
        logits = logits_of(list(prompt) + list(engine[:at]))
        top2 = torch.topk(logits, 2).indices.tolist()
        mine = engine[at]
        other = top2[1] if top2[0] == mine else top2[0]
        row = {"request": i, "position": at, "engine_token": mine, "reference_top2": top2,
               "steps_to_runner_up": round(bf16_steps(logits, mine, other), 3)}
        served = entry.get("served_token")
        if served is not None:
            row["served_token"] = served
            row["steps_to_served"] = round(bf16_steps(logits, mine, served), 3)
        rows.append(row)
    return rows


def main() -> None:
    from piecegraph.cli_common import load_model
    from piecegraph.models import QWEN2_5_0_5B, TINY

    parser = argparse.ArgumentParser()
    parser.add_argument("reference")
    parser.add_argument("checks", nargs="+")
    parser.add_argument("--json")
    args = parser.parse_args()
    with open(args.reference, encoding="utf-8") as f:
        reference = json.load(f)
    out = {}
    for path in args.checks:
        with open(path, encoding="utf-8") as f:
            check = json.load(f)
        name, presets = check["model"], {"qwen2.5-0.5b": QWEN2_5_0_5B, "tiny": TINY}
        if name not in presets:
            raise SystemExit(f"{path}: model {name!r} is not a preset this judge rebuilds ({', '.join(presets)})")
        if check["prompts"] != len(reference["prompts"]):
            raise SystemExit(f"{path} checked {check['prompts']} prompts, {args.reference} holds "
                             f"{len(reference['prompts'])}: not the same check")
        config = presets[name]
        model = load_model(name, "cpu", torch.bfloat16).float()  # bf16 weights, float32 arithmetic
        rows = judge(reference, check, _logits_of(model, config))
        out[os.path.basename(path)] = rows
        for row in rows:
            print(os.path.basename(path), json.dumps(row))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
