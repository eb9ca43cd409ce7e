"""The judge of scripts/http_tokens.py, which judges a GPU token check's divergences afterwards on CPU: its reference
logits are the model's (not its hidden states), so at every position of a greedy float32 run the engine's token is
the reference's first choice, and a token the reference ranks second is a small number of bf16 steps away. It reads
the check's files in the one result schema and refuses a check it cannot rebuild or match."""

import random

import torch
from script_helpers import load_script

from piecegraph.cli_common import load_model
from piecegraph.models import TINY
from piecegraph.serve import Engine, EngineConfig, SamplingParams


def _script():
    return load_script("http_tokens")


def test_the_judge_reads_the_models_logits_at_each_divergence():
    judge = _script()
    model = load_model("tiny", "cpu", torch.bfloat16).float()  # what the script rebuilds: bf16 weights, fp32 math
    rng = random.Random(3)
    prompts = [[rng.randrange(TINY.vocab_size) for _ in range(rng.randint(4, 40))] for _ in range(4)]
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=4, page_size=8, max_seq_len=128))
    tokens = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    reference = {"prompts": prompts, "tokens": tokens}
    positions = [0, 3, 7, 11]
    differ = [{"request": i, "position": p} for i, p in enumerate(positions)]
    rows = judge.judge(reference, differ, judge.logits_of(model, TINY))
    assert [(r["request"], r["position"]) for r in rows] == list(enumerate(positions))
    for row, i, p in zip(rows, range(4), positions):
        assert row["engine_token"] == tokens[i][p] == row["reference_top2"][0], row
        assert row["steps_to_runner_up"] > 0
    # the server's token, when recorded, is measured against the engine's: its own token is 0 steps away
    differ[0]["served_token"] = tokens[0][0]
    assert judge.judge(reference, differ, judge.logits_of(model, TINY))[0]["steps_to_served"] == 0


def test_the_judge_refuses_a_check_it_cannot_rebuild_or_match(tmp_path, monkeypatch):
    import pytest

    from piecegraph.results.schema import environment, write_result

    judge = _script()
    ref, check = tmp_path / "ref.json", tmp_path / "check.json"
    write_result(ref, "http_tokens_reference", environment(attention="torch", model="tiny", dtype="float32",
                                                          quant=None), [{"prompt": [1, 2], "tokens": [3, 4]}], new=2)
    for model, prompts, words in (("llama-7b-shape", 1, "'llama-7b-shape' is not a preset"),
                                  ("tiny", 16, "checked 16 prompts")):
        env = environment(attention="torch", model=model, dtype="float32", quant=None)
        write_result(check, "http_tokens", env, [{"request": 0, "equal": True}], prompts=prompts)
        monkeypatch.setattr("sys.argv", ["http_tokens.py", "judge", str(ref), str(check)])
        with pytest.raises(SystemExit, match=words):
            judge.main()


def test_the_judge_reads_a_checks_divergences_and_writes_its_rows(tmp_path, monkeypatch, capsys):
    import json

    from piecegraph.results.schema import environment, load_result, write_result

    judge = _script()
    model = load_model("tiny", "cpu", torch.bfloat16).float()
    prompts = [[5, 6, 7], [8, 9]]
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=2, page_size=8, max_seq_len=64))
    tokens = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    env = environment(attention="torch", model="tiny", dtype="float32", quant=None)
    ref, check = tmp_path / "ref.json", tmp_path / "check.json"
    write_result(ref, "http_tokens_reference", env, [{"prompt": p, "tokens": t} for p, t in zip(prompts, tokens)],
                 new=4)
    write_result(check, "http_tokens", env, [{"request": 0, "equal": True},
                                             {"request": 1, "equal": False, "position": 2}], prompts=2)
    monkeypatch.setattr("sys.argv", ["http_tokens.py", "judge", str(ref), str(check), "--out", str(tmp_path)])
    judge.main()
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["request"], r["position"], r["check"]) for r in printed] == [(1, 2, "check.json")]
    written = load_result(next(tmp_path.glob("*_cpu_http_tokens_judge.json")))
    assert written.benchmark == "http_tokens_judge" and written.rows == printed
