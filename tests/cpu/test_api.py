"""``piecegraph.compile``'s options: a keyword given explicitly always wins over ``config=``; one left out keeps it."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import piecegraph
from piecegraph import Config

MODEL = torch.nn.Linear(4, 4)
UNSET = object()
modes = st.sampled_from(["piecewise", "full", "none", "breakable", "auto"])
compilers = st.sampled_from(["inductor", "eager"])
tokens = st.integers(1, 4096)


@given(config_mode=modes, config_tokens=tokens, config_compiler=compilers,
       mode=st.one_of(st.just(UNSET), modes), max_tokens=st.one_of(st.just(UNSET), tokens),
       compiler=st.one_of(st.just(UNSET), compilers), verify=st.one_of(st.just(UNSET), st.booleans()))
def test_explicit_keywords_win_over_config(config_mode, config_tokens, config_compiler, mode, max_tokens, compiler,
                                           verify):
    config = Config(mode=config_mode, max_tokens=config_tokens, compiler=config_compiler, verify=True)
    given_kw = {k: v for k, v in dict(mode=mode, max_tokens=max_tokens, compiler=compiler, verify=verify).items()
                if v is not UNSET}
    got = piecegraph.compile(MODEL, config=config, **given_kw).config
    for name in ("mode", "max_tokens", "compiler", "verify"):
        assert getattr(got, name) == given_kw.get(name, getattr(config, name)), name


def test_the_reported_case_and_the_defaults():
    got = piecegraph.compile(MODEL, mode="piecewise", config=Config(mode="full")).config
    assert got.mode == "piecewise"  # equal to the default, given explicitly: it wins
    assert piecegraph.compile(MODEL, config=Config(mode="full")).config.mode == "full"
    assert piecegraph.compile(MODEL).config == Config()
    assert piecegraph.compile(MODEL, capture_sizes=[8, 2]).config.sizes == (2, 8)
