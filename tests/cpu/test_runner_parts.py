"""The runner's parts on their own: the size table's bucket choice, staging into static buffers (padding zeroed,
writes copied back), and outputs cut back to the call's tokens. The runner as a whole is tested through
GraphedModule in test_contract.py, test_extra_runs.py and others."""

import pytest
import torch

from piecegraph.program import CaptureState, InputKind, Program, TokenCountMismatch
from piecegraph.runner.outputs import cut_to_tokens
from piecegraph.runner.sizes import SizeTable
from piecegraph.runner.staging import Staging

TOKENS, COUNT, STATIC = InputKind.TOKENS, InputKind.COUNT, InputKind.STATIC


def _program(kinds, mutated=()):
    return Program(call=lambda *a: a, state=CaptureState(), pieces=[], infos=[], kinds=list(kinds),
                   token_outputs=[True], dynamic=True, names=[f"in{i}" for i in range(len(kinds))],
                   mutated_inputs=list(mutated))


def test_bucket_is_the_smallest_size_that_holds_the_call():
    table = SizeTable((1, 2, 4, 8))
    assert [table.bucket(n) for n in (1, 3, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]
    table.record_capture(4, 0.5)
    table.drop(4, error=0.3)  # verification failed: its calls run without a graph
    assert table.bucket(3) is None and not table.is_captured(4) and table.dropped == {4: 0.3}


def test_exact_sizes_serve_only_their_own_count():
    table = SizeTable((2, 8), exact=True)
    assert (table.bucket(2), table.bucket(3), table.bucket(8)) == (2, None, 8)
    static = SizeTable(())
    static.set_static(5)
    assert static.largest == 5 and static.bucket(5) == 5


def test_stage_pads_with_zeros_and_never_writes_the_callers_tensor():
    staging = Staging(_program([TOKENS, COUNT, STATIC]), token_dim=0, names=["x", "n", "w"])
    x, w = torch.ones(3, 2), torch.zeros(2)
    staging.stage([torch.full((8, 2), 7.0), 8, w], 8, 8, largest=8)  # garbage from an earlier, larger call
    padded = staging.stage([x, 3, w], 3, 4, largest=8)
    assert padded[0].shape == (4, 2) and padded[1] == 4 and padded[2] is w
    assert torch.equal(padded[0][:3], x) and torch.equal(padded[0][3], torch.zeros(2))
    assert padded[0].data_ptr() == staging.buffers[0].data_ptr() and torch.equal(x, torch.ones(3, 2))


def test_written_inputs_are_saved_restored_and_copied_back():
    staging = Staging(_program([TOKENS], mutated=[0]), token_dim=0, names=["x"])
    x = torch.ones(3, 2)
    padded = staging.stage([x], 3, 4, largest=4)
    saved = staging.save_written(padded)
    padded[0].add_(1)  # a warm-up run wrote it: restored before the call's own run
    staging.restore(padded, saved)
    assert torch.equal(padded[0][:3], x)
    padded[0].mul_(5)  # the call's own run wrote it: the caller sees it, as in eager
    staging.write_back([x], padded, 3)
    assert torch.equal(x, torch.full((3, 2), 5.0))


def test_token_counts_are_read_and_checked():
    staging = Staging(_program([TOKENS, TOKENS]), token_dim=0, names=["x", "pos"])
    assert staging.num_tokens([torch.ones(3, 2), torch.ones(3)]) == 3
    with pytest.raises(TokenCountMismatch, match="inputs x and pos disagree on the token count"):
        staging.num_tokens([torch.ones(3, 2), torch.ones(4)])
    with pytest.raises(ValueError, match=r"input pos is 5: it has no dim token_dim=0"):
        staging.num_tokens([torch.ones(3, 2), 5])


def test_outputs_are_cut_to_the_calls_tokens_and_copied():
    out, table = torch.arange(8.0).reshape(4, 2), torch.ones(2)
    cut = cut_to_tokens([out, table, None], 3, 0, [True, False, False], copy=True)
    assert torch.equal(cut[0], out[:3]) and cut[0].data_ptr() != out.data_ptr() and cut[2] is None
    views = cut_to_tokens([out], 3, 0, [True], copy=False)
    assert views[0].data_ptr() == out.data_ptr()
