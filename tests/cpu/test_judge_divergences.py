"""scripts/judge_divergences.py, which judges a GPU token check's divergences afterwards on CPU: its reference
logits are the model's (not its hidden states), so at every position of a greedy float32 run the engine's token is
the reference's first choice, and a token the reference ranks second is a small number of bf16 steps away."""

import importlib.util
import random
from pathlib import Path

import torch

from piecegraph.cli_common import load_model
from piecegraph.models import TINY
from piecegraph.serve import Engine, EngineConfig, SamplingParams

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "judge_divergences.py"


def _script():
    spec = importlib.util.spec_from_file_location("judge_divergences", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_judge_reads_the_models_logits_at_each_divergence():
    judge = _script()
    model = load_model("tiny", "cpu", torch.bfloat16).float()  # what the script rebuilds: bf16 weights, fp32 math
    rng = random.Random(3)
    prompts = [[rng.randrange(TINY.vocab_size) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=4, page_size=8, max_seq_len=128))
    tokens = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    reference = {"prompts": prompts, "tokens": tokens}
    positions = [0, 3, 7, 11]
    check = {"model": "tiny", "differ": [{"request": i, "position": p} for i, p in enumerate(positions)]}
    rows = judge.judge(reference, check, judge._logits_of(model, TINY))
    assert [(r["request"], r["position"]) for r in rows] == list(enumerate(positions))
    for row, i, p in zip(rows, range(4), positions):
        assert row["engine_token"] == tokens[i][p] == row["reference_top2"][0], row
        assert row["steps_to_runner_up"] > 0
    # the server's token, when recorded, is measured against the engine's: its own token is 0 steps away
    check["differ"][0]["served_token"] = tokens[0][0]
    assert judge.judge(reference, check, judge._logits_of(model, TINY))[0]["steps_to_served"] == 0


def test_the_judge_refuses_a_check_it_cannot_rebuild_or_match(tmp_path, monkeypatch):
    import json

    import pytest

    judge = _script()
    ref, check = tmp_path / "ref.json", tmp_path / "check.json"
    ref.write_text(json.dumps({"prompts": [[1, 2]], "tokens": [[3, 4]]}))
    for body, words in (({"model": "llama-7b-shape", "prompts": 1, "differ": []}, "'llama-7b-shape' is not a preset"),
                        ({"model": "tiny", "prompts": 16, "differ": []}, "checked 16 prompts")):
        check.write_text(json.dumps(body))
        monkeypatch.setattr("sys.argv", ["judge_divergences.py", str(ref), str(check)])
        with pytest.raises(SystemExit, match=words):
            judge.main()
