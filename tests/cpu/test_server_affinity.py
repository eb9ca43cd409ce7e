"""``piecegraph serve --engine-cpus``: the CPU lists, the split between the engine and the front ends, and a real
engine process pinned to its CPUs serving the same tokens."""

import functools
import os
import sys

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from piecegraph.server.affinity import AUTO_ENGINE_CPUS, format_cpus, parse_cpus, split_cpus  # noqa: E402
from piecegraph.server.command import cpu_split  # noqa: E402

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")


@given(st.frozensets(st.integers(0, 300), min_size=1))
def test_a_cpu_list_reads_back_as_the_same_set(cpus):
    text = format_cpus(cpus)
    assert parse_cpus(text) == cpus
    assert len(text.split(",")) == sum(1 for c in cpus if c - 1 not in cpus)  # one run per gap: the short form


@pytest.mark.parametrize("text", ["", "a", "1-", "-2", "3-1", "1,,2", "0x1"])
def test_a_bad_cpu_list_says_which_part(text):
    with pytest.raises(ValueError, match="range|CPU number"):
        parse_cpus(text)


def test_auto_gives_the_engine_the_highest_cpus_and_the_rest_to_the_front_ends():
    available = frozenset(range(16))
    engine, rest = split_cpus("auto", available)
    assert engine == frozenset(range(16 - AUTO_ENGINE_CPUS, 16)) and rest == available - engine
    assert split_cpus("auto", frozenset(range(4))) is None  # too few to split: nothing pinned
    assert split_cpus("none", available) is None
    assert split_cpus("0,2", available) == (frozenset({0, 2}), available - {0, 2})


def test_a_list_outside_this_process_or_taking_every_cpu_is_refused():
    with pytest.raises(ValueError, match=r"\[9\] are not among"):
        split_cpus("8-9", frozenset(range(9)))
    with pytest.raises(ValueError, match="no CPU for the HTTP front ends"):
        split_cpus("0-3", frozenset(range(4)))


def test_the_cli_names_the_option_for_every_refusal():
    assert cpu_split("none", engine_process=False) is None
    with pytest.raises(typer.BadParameter, match="own process") as err:
        cpu_split("auto", engine_process=False)
    assert err.value.param_hint == "--engine-cpus"
    if hasattr(os, "sched_setaffinity"):
        with pytest.raises(typer.BadParameter) as err:
            cpu_split(str(max(os.sched_getaffinity(0)) + 1), engine_process=True)
        assert err.value.param_hint == "--engine-cpus"


@linux_only
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs two CPUs to split")
def test_a_pinned_engine_process_runs_on_its_cpus_and_serves_the_same_tokens():
    import torch

    from piecegraph.serve import EngineConfig, SamplingParams
    from piecegraph.server.command import build_engine
    from piecegraph.server.run import BackgroundServer, build_process_state
    from piecegraph.server.tokenizer import ByteTokenizer

    sys.path.insert(0, os.path.dirname(__file__))
    from server_helpers import NEW, TOK, completion, text_prompts  # noqa: E402

    mine = os.sched_getaffinity(0)
    engine_cpus = frozenset({max(mine)})
    config = EngineConfig(mode="eager", max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_seq_len=256)
    factory = functools.partial(build_engine, "tiny", "cpu", torch.float32, False, config)
    prompts = text_prompts(3, seed=11)
    want = factory().generate([TOK.encode(p) for p in prompts], SamplingParams(max_new_tokens=NEW))
    state = build_process_state(factory, ByteTokenizer, "tiny", max_pending=8, drain_s=5, engine_cpus=engine_cpus)
    with BackgroundServer(state) as server:
        assert os.sched_getaffinity(state.loop._proc.pid) == engine_cpus
        got = [completion(server.url, p, True)[1] for p in prompts]
    assert got == want
    assert os.sched_getaffinity(0) == mine  # pinning the engine process leaves this one alone
