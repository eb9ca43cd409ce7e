"""Property: for a random signature (tensor arguments with a token dimension and static ones, of several dtypes;
some written in place) and random shape rules for its outputs, the fake inferred by probing gives the real
outputs' shapes and dtypes at token counts never probed, or its guard refuses the call (never a wrong shape), and
``mutates`` names exactly the arguments written. With the same call recorded at a second token count (a twin), the
guard accepts every token count; without one, a static size that equals the token count may be taken for a token
dimension, and then only the guard stands between the fake and a wrong shape. Rules of the rule language are never
refused; a rule outside it (a round-up to a block of tokens) is refused or exact, never wrong."""

import inspect

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from piecegraph.ops.probe_calls import Call, ProbeRefused
from piecegraph.ops.probe_fake import infer_fake
from piecegraph.ops.signature import make_fake

DTYPES = (torch.float32, torch.float64, torch.int32)
IN_LANGUAGE = ("tok", "dim", "half", "double", "sum", "const")


def _dim_value(rule: tuple, shapes: dict) -> int:
    kind = rule[0]
    if kind == "tok":
        return shapes[rule[1]][0]
    if kind == "const":
        return rule[1]
    if kind == "block":
        n, q = shapes[rule[1]][0], rule[2]
        return (n + q - 1) // q * q
    if kind == "sum":
        return shapes[rule[1][0]][rule[1][1]] + shapes[rule[2][0]][rule[2][1]]
    size = shapes[rule[1]][rule[2]]
    return {"dim": size, "half": size // 2, "double": size * 2}[kind]


@st.composite
def signatures(draw):
    count = draw(st.integers(1, 3))
    tensors = []  # (token?, static dims, dtype)
    for i in range(count):
        token = i == 0 or draw(st.booleans())
        static = draw(st.lists(st.integers(1, 9), min_size=0 if token else 1, max_size=2))
        tensors.append((token, static, draw(st.sampled_from(DTYPES))))
    names = [f"t{i}" for i in range(count)]
    tokens = [n for n, t in zip(names, tensors) if t[0]]
    dims = [(n, d) for n, t in zip(names, tensors) for d in range(int(t[0]) + len(t[1]))]  # token dims too
    rule = st.one_of(
        st.sampled_from(tokens).map(lambda n: ("tok", n)),
        st.sampled_from(dims).map(lambda nd: ("dim", *nd)),
        st.sampled_from(dims).map(lambda nd: ("half", *nd)),
        st.sampled_from(dims).map(lambda nd: ("double", *nd)),
        st.tuples(st.sampled_from(dims), st.sampled_from(dims)).map(lambda p: ("sum", *p)),
        st.integers(1, 5).map(lambda c: ("const", c)),
        st.tuples(st.sampled_from(tokens), st.sampled_from((8, 16, 64))).map(lambda p: ("block", *p)),
    )
    out_dtype = st.one_of(st.sampled_from(names).map(lambda n: ("like", n)), st.sampled_from(DTYPES))
    outputs = draw(st.lists(st.tuples(st.lists(rule, min_size=1, max_size=3), out_dtype), min_size=0, max_size=2))
    writes = draw(st.sets(st.sampled_from(names), max_size=1 if outputs else 1).filter(lambda w: w or outputs))
    as_tuple = len(outputs) > 1 or (len(outputs) == 1 and draw(st.booleans()))
    return names, tensors, outputs, sorted(writes), as_tuple, draw(st.integers(2, 9)), draw(st.booleans())


def _function(names, outputs, writes, as_tuple):
    def fn(*args):
        values = dict(zip(names, args))
        for name in writes:
            values[name].add_(1)
        shapes = {k: tuple(v.shape) for k, v in values.items()}
        outs = tuple(torch.zeros([_dim_value(r, shapes) for r in rules],
                                 dtype=values[dt[1]].dtype if isinstance(dt, tuple) else dt) for rules, dt in outputs)
        return None if not outs else outs if as_tuple else outs[0]

    fn.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                          for n in names])
    return fn


def _values(names, tensors, n, gen):
    values = {}
    for name, (token, static, dtype) in zip(names, tensors):
        shape = ([n] if token else []) + list(static)
        values[name] = (torch.randn(shape, generator=gen) * 4).to(dtype)
    return values


@settings(max_examples=40, deadline=None)
@given(signatures(), st.lists(st.integers(1, 300), min_size=3, max_size=3), st.integers(0, 2**16))
def test_inferred_fake_equals_the_real_outputs_at_counts_never_probed(signature, counts, seed):
    names, tensors, outputs, writes, as_tuple, t, twin = signature
    fn, gen = _function(names, outputs, writes, as_tuple), torch.Generator().manual_seed(seed)
    values = _values(names, tensors, t, gen)
    twin_shapes = {k: tuple(v.shape) for k, v in _values(names, tensors, t + 2, gen).items()} if twin else None
    recorded = {k: v.clone() for k, v in values.items()}
    in_language = all(r[0] in IN_LANGUAGE for rules, _ in outputs for r in rules)
    try:
        inferred = infer_fake(fn, [Call(values, t, twin_shapes, t + 2 if twin else 0)])
    except ProbeRefused as err:
        assert not in_language, f"refused a rule of the language: {err}"
        return
    assert all(torch.equal(values[k], recorded[k]) for k in values)  # probing never wrote the recorded tensors
    assert list(inferred.mutates) == writes
    fake = make_fake(inferred.spec, names, inferred.ret, "property")
    for n in counts:
        call = _values(names, tensors, n, gen)
        accepted = any(case.accepts(call) for case in inferred.cases)
        assert accepted or not twin, "with a twin, every token count is a call the fake holds for"
        if not accepted:
            continue  # the traced call would raise AutoOpaqueUnseen: loud, never a wrong shape
        args = list(call.values())
        real = fn(*[a.clone() for a in args])
        got = fake(*args)
        real = () if real is None else real if isinstance(real, tuple) else (real,)
        got = () if got is None else tuple(got) if isinstance(got, (tuple, list)) else (got,)
        assert [(tuple(g.shape), g.dtype) for g in got] == [(tuple(r.shape), r.dtype) for r in real], \
            (n, inferred.fake.text)


def _positive_rows(x: torch.Tensor) -> torch.Tensor:
    return x[x.sum(-1) > 0]  # how many rows: decided by the data


@settings(max_examples=60, deadline=None)
@given(half=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_data_dependent_output_shapes_are_refused_as_such_for_any_recorded_data(half, seed):
    """Whatever data the forward recorded, a sign filter is named as data-dependent: at an even token count the
    probe's rows (t + 3) are odd, so the negated data keeps another number of rows; draws cover the rest. (One
    random draw tied by chance: the refusal then named no data dependence, only a missing shape rule.)"""
    t = 2 * half + 2
    x = torch.randn(t, 8, generator=torch.Generator().manual_seed(seed))
    x[:, 0] += torch.where(x.sum(-1) == 0, 1.0, 0.0)  # no row sums to exactly 0 (it would stay 0 negated)
    try:
        infer_fake(_positive_rows, [Call({"x": x}, t)])
    except ProbeRefused as err:
        assert "depend on the data" in str(err)
    else:
        raise AssertionError("a data-dependent output shape was given a fake")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-50, 50), min_size=2, max_size=40), st.sampled_from((torch.int32, torch.int64)),
       st.booleans())
def test_other_data_keeps_recorded_offsets_sorted_and_in_range(values, dtype, sort):
    """The data-dependence probe's random draws of an integer tensor stay in its range, and stay sorted where the
    recorded one is (offsets such as a grouped GEMM's ``seg_indptr``: unsorted ones fault a GPU kernel); the
    negated draw keeps integers as recorded."""
    from piecegraph.ops.probe_fake import OTHER_DATA_SEEDS, _other_data

    recorded = torch.tensor(sorted(values) if sort else values, dtype=dtype)
    rows = torch.stack([recorded, recorded.flip(0).sort().values])  # a 2-d batch of offsets, sorted per row
    for seed in OTHER_DATA_SEEDS:
        drawn = _other_data({"indptr": recorded, "rows": rows}, seed)
        for name, before in (("indptr", recorded), ("rows", rows)):
            after = drawn[name]
            assert after.shape == before.shape and after.dtype == before.dtype
            assert int(after.min()) >= int(before.min()) and int(after.max()) <= int(before.max())
            if bool((before.diff(dim=-1) >= 0).all()):
                assert bool((after.diff(dim=-1) >= 0).all()), (seed, before, after)
        if seed is None:
            assert torch.equal(drawn["indptr"], recorded)
