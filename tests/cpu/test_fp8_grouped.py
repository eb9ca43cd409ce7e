"""The "scaled_grouped_mm" FP8 experts (piecegraph.models.fp8_grouped) on CPU, with an injected timer: the choice
table, the dispatch at every token count against each path forced (exactly) and each path against an independent
reference (a float64 pair-at-a-time product of the same e4m3 values; the reference decoder's own experts), pad rows,
and graphs (the opaque op's branch baked per captured size) token for token against eager."""

from __future__ import annotations

import warnings

import pytest
import torch

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.models import TINY_MOE, MoEDecoder, fp8_grouped, generate, quantize_fp8
from piecegraph.models.fp8 import quantize_rows
from piecegraph.models.fp8_grouped import picks_fp8, quantize_channels, token_sizes
from piecegraph.models.fp8_moe import FP8Experts

MAX_TOKENS = 16
DENSE_AT = {1, 2, 16}  # the injected timer's losses for FP8: not monotone on purpose
PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 1], [200, 13, 54, 2, 8, 31, 77]]


class Timer:
    """Says FP8 takes 30 us at :data:`DENSE_AT` and 10 us elsewhere, the dense path 20 us; runs each layer once
    (a timer must run it) and records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, path: str, tokens: int, run) -> float:
        out = run()
        assert out.shape == (tokens, TINY_MOE.hidden_size) and torch.isfinite(out).all()
        self.calls.append((path, tokens))
        if path == "fp8":
            return 30.0 if tokens in DENSE_AT else 10.0
        return 20.0


@pytest.fixture(scope="module")
def pair():
    """The float model and its FP8 form (same seeded weights), measured once by the injected timer."""
    timer = Timer()
    fp8 = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=7), expert_kernel="scaled_grouped_mm",
                       max_tokens=MAX_TOKENS, timer=timer)
    return MoEDecoder.random(TINY_MOE, seed=7), fp8, timer


def _inputs(block, n, seed=0):
    x = torch.randn(n, TINY_MOE.hidden_size, generator=torch.Generator().manual_seed(seed))
    weights, ids = block.route(x)
    return x, ids, weights


def _dequant_rows(x):
    q, scale = quantize_rows(x)
    return q.double() * scale.double().unsqueeze(-1)


def _fp8_reference(experts, x, ids, weights):
    """One (token, expert) pair at a time in float64: the module's e4m3 weights times their per-channel scales,
    the activations quantized per row (no sort, no groups, no scatter)."""
    gate_up = experts.gate_up.double() * experts.gate_up_scale.double().unsqueeze(-1)
    down = experts.down.double() * experts.down_scale.double().unsqueeze(-1)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            u = gate_up[e] @ _dequant_rows(x[t:t + 1])[0]
            g, v = u[: experts.width], u[experts.width:]
            h = (g * torch.sigmoid(g) * v).float()
            out[t] += float(weights[t, j]) * (down[e] @ _dequant_rows(h.unsqueeze(0))[0])
    return out


def test_token_sizes_and_the_pick_of_a_count_between_them():
    assert token_sizes(2048) == [2**i for i in range(12)]
    assert token_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100] and token_sizes(1) == [1]
    sizes, fp8 = [1, 2, 4, 8], [False, True, False, True]
    # the smallest measured size >= tokens, else the largest
    assert [picks_fp8(n, sizes, fp8) for n in range(1, 12)] == [False, True, False, False] + [True] * 7
    with pytest.raises(ValueError, match="max_tokens"):
        token_sizes(0)


def test_per_channel_weights_are_within_half_an_e4m3_step():
    w = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 2, 40)[:, None]
    q, scale = quantize_channels(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 40) and q.is_contiguous()
    back = q.double() * scale.double().unsqueeze(-1)
    bound = 2.0**-4 * w.double().abs() + 2.0**-10 * scale.double().unsqueeze(-1)
    assert ((back - w.double()).abs() <= bound * (1 + 1e-6)).all()
    assert torch.allclose(back.abs().amax(-1), w.double().abs().amax(-1), rtol=2.0**-4)  # each row's max ~ 448


def test_the_table_is_measured_once_per_shape_and_shown(pair):
    _, fp8, timer = pair
    layers = [layer.mlp.experts for layer in fp8.model.layers]
    assert len(layers) == 2 and all(isinstance(e, FP8Experts) for e in layers)
    sizes = token_sizes(MAX_TOKENS)
    # both layers share the shape: one measurement of each path per size, not one per layer
    assert sorted(timer.calls) == sorted((p, n) for p in ("fp8", "dense") for n in sizes)
    table = layers[0].kernel_table()
    assert table == layers[1].kernel_table()
    assert [(r["tokens"], r["kernel"]) for r in table] == [(n, "dense" if n in DENSE_AT else "fp8") for n in sizes]
    assert all(r["dense_us"] == 20.0 and r["fp8_us"] in (10.0, 30.0) for r in table)
    text = repr(layers[0])
    assert "kernel=scaled_grouped_mm" in text and "1: dense (30 vs 20 us)" in text and "4: fp8 (10 vs 20 us)" in text
    assert layers[0].gate_up_dense is not None  # some size picks the dense path: its weights are kept


@torch.no_grad()
def test_each_token_count_gives_exactly_the_chosen_paths_output(pair):
    float_model, fp8, _ = pair
    block, reference = fp8.model.layers[0].mlp, float_model.model.layers[0].mlp.experts
    experts = block.experts
    for n in range(1, MAX_TOKENS + 4):  # beyond the largest measured size: its choice
        x, ids, weights = _inputs(block, n, seed=n)
        got = experts(x, ids, weights)
        as_fp8 = experts._run(x, ids, weights, [1], [True], [False])
        as_dense = experts._run(x, ids, weights, [1], [False], [False])
        want_dense = min((s for s in token_sizes(MAX_TOKENS) if s >= n), default=MAX_TOKENS) in DENSE_AT
        assert torch.equal(got, as_dense if want_dense else as_fp8), n
        assert not torch.equal(as_fp8, as_dense), n  # the two paths differ: the equality above says which ran
        # each path against an independent reference
        torch.testing.assert_close(as_dense, reference(x, ids, weights), rtol=1e-5, atol=1e-6)
        ref = _fp8_reference(experts, x, ids, weights)
        assert ((as_fp8.double() - ref).abs().max() / ref.abs().max()) < 1e-5, n


@torch.no_grad()
def test_pad_rows_never_change_real_rows(pair):
    """Up to float32 reduction order (CPU kernels pick their vectorization by the batch shape: one ulp seen); a
    pad row mixed into a real row's scale or sum would move it by far more (the pads are 40x the real rows)."""
    _, fp8, _ = pair
    block = fp8.model.layers[1].mlp
    for real, total in ((3, 8), (1, 2)):  # padded within one choice: FP8 at 4 and 8, dense at 1 and 2
        x, ids, weights = _inputs(block, real, seed=real)
        got = block.experts(x, ids, weights)
        for pad in (torch.zeros(total - real, x.shape[1]), torch.randn(total - real, x.shape[1]) * 40):
            padded = torch.cat([x, pad])
            w2, i2 = block.route(padded)
            torch.testing.assert_close(block.experts(padded, i2, w2)[:real], got, rtol=1e-6, atol=1e-7)


def test_dense_weights_are_dropped_when_fp8_wins_everywhere_and_cpu_defaults_stay_torch():
    def fp8_always(path, tokens, run):
        return 1.0 if path == "fp8" else 2.0

    model = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=1), expert_kernel="scaled_grouped_mm", max_tokens=4,
                         timer=fp8_always)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_dense is None and experts.down_dense is None
    assert not any(name.endswith("_dense") for name, _ in model.named_buffers())
    assert {r["kernel"] for r in experts.kernel_table()} == {"fp8"}
    default = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=1))  # CPU: the float32 reference kernel
    assert default.model.layers[0].mlp.experts.kernel == "torch"
    assert default.model.layers[0].mlp.experts.kernel_table() == []
    with pytest.raises(ValueError, match="expert_kernel"):
        quantize_fp8(MoEDecoder.random(TINY_MOE, seed=1), expert_kernel="flashinfer")


def test_graphs_bake_the_choice_of_each_captured_size(pair, monkeypatch):
    """Decode batches of 3 pad to the 4-token graph (FP8), the 15-token prefill to the 16-token one (dense):
    the opaque op reads the padded count at each replay, and the tokens equal eager's."""
    _, model, _ = pair
    ran = []
    for name in ("_fp8_mlp", "_dense_mlp"):
        original = getattr(fp8_grouped, name)
        monkeypatch.setattr(fp8_grouped, name, lambda xs, *a, _f=original, _n=name: ran.append((_n, xs.shape[0]))
                            or _f(xs, *a))

    def cache():
        return KVCache.for_sequences(TINY_MOE, len(PROMPTS), max(map(len, PROMPTS)) + 6, page_size=4)

    expected = generate(model, PROMPTS, max_new_tokens=4, cache=cache())
    options = {"compiler": "eager", "emulate_graphs": True}
    prefill = piecegraph.compile(model, mode="piecewise", capture_sizes=(16,), **options)
    decode = piecegraph.compile(model, mode="full", capture_sizes=(4,), **options)
    ran.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = generate(model, PROMPTS, max_new_tokens=4, prefill_fn=prefill, decode_fn=decode, cache=cache())
    assert got == expected
    assert prefill.stats()["fallbacks"] == 0 and decode.stats()["replays"] >= 2
    k, experts = TINY_MOE.top_k, model.model.layers[0].mlp.experts
    # the replays ran the padded sizes' paths (the traces' first calls ran the real sizes, eagerly); every call
    # ran the path the table gives its row count
    assert {("_dense_mlp", 16 * k), ("_fp8_mlp", 4 * k)} <= set(ran), set(ran)
    for path, rows in ran:
        assert path == ("_fp8_mlp" if picks_fp8(rows // k, experts.sizes, experts.use_fp8) else "_dense_mlp")


def test_kept_dense_experts_count_as_held_but_not_as_read(pair):
    """ModelFacts of an FP8 MoE whose table keeps the model-dtype experts: they are memory the model holds
    (weight_bytes), but a step reads one form of each expert, so the expert bytes a forward reads are the FP8
    form's alone (a bandwidth fraction is never overstated)."""
    _, fp8, _ = pair
    facts = fp8.facts()
    dense = [t for name, t in fp8.named_buffers() if name.endswith("_dense")]
    assert dense, "the injected table picks the dense path at some sizes: the dense experts are kept"
    dense_bytes = sum(t.numel() * t.element_size() for t in dense)
    fp8_expert_bytes = sum(t.numel() * t.element_size() for name, t in fp8.named_buffers()
                           if ".experts." in name and not name.endswith("_dense") and t.is_floating_point())
    assert facts.expert_bytes == fp8_expert_bytes
    held = {id(t): t for t in [*fp8.parameters(), *(b for b in fp8.buffers() if b.is_floating_point())]}
    assert facts.weight_bytes == sum(t.numel() * t.element_size() for t in held.values())
    assert facts.weight_bytes >= dense_bytes + fp8_expert_bytes
