"""The doctor's capture probe on CUDA: a piece that calls .item() and one that syncs are named to the node."""

import pytest
import torch

import piecegraph
from piecegraph.diagnose.probe import probe_model

pytestmark = pytest.mark.gpu


class ItemPiece(torch.nn.Module):
    """One piece: the .item() lands inside it (the probe traces with capture_scalar_outputs)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x) * 2
        s = y.sum().item()
        return y + s


def synchronize_and_double(x: torch.Tensor) -> torch.Tensor:
    torch.cuda.synchronize()
    return x * 2


# An opaque op keeps the sync inside the traced piece: Dynamo 2.11 breaks the graph at a bare synchronize().
synchronize_and_double_op = piecegraph.opaque(synchronize_and_double, fake="like:x")


class SyncPiece(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = synchronize_and_double_op(self.lin(x) * 2)
        return torch.relu(y) + 1


class Clean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.silu(self.lin(x))


def _x():
    return torch.randn(8, 16, device="cuda")


def test_probe_names_the_item_node():
    pieces, failures = probe_model(ItemPiece().cuda(), (_x(),))
    assert pieces >= 1 and len(failures) == 1, failures
    fail = failures[0]
    assert fail.why.startswith(".item()"), fail
    assert fail.node is not None and ("item" in fail.node or "local_scalar_dense" in fail.target), fail
    assert fail.location.endswith(f"test_doctor_gpu.py:{ItemPiece.forward.__code__.co_firstlineno + 2}"), fail


def test_probe_names_the_sync_node():
    pieces, failures = probe_model(SyncPiece().cuda(), (_x(),))
    assert pieces >= 1 and len(failures) == 1, failures
    fail = failures[0]
    assert fail.why.startswith("device sync"), fail
    assert "synchronize" in fail.target.lower() or "synchronize" in (fail.node or ""), fail


def test_doctor_reports_capture_findings_and_fails():
    report = piecegraph.doctor(SyncPiece().cuda(), _x())
    capture = [f for f in report.findings if f.kind == "capture"]
    assert not report.ok and capture, report.json()
    assert capture[0].fix and "synchronize" in capture[0].primitive.lower()
    assert piecegraph.doctor.__module__ == "piecegraph.diagnose.core"
    from piecegraph.diagnose import validate

    assert validate(report.json()) == []


def test_clean_model_captures_and_is_ok():
    report = piecegraph.doctor(Clean().cuda(), _x())
    assert report.ok, report.json()
    assert report.pieces == 1 and report.device == "cuda"


def test_reference_decoder_captures_every_piece():
    from piecegraph.attention import KVCache
    from piecegraph.models import TINY, Decoder, dummy_inputs

    model = Decoder.random(TINY, seed=0, device="cuda").eval()
    cache = KVCache.for_sequences(model.config, 2, 32, dtype=torch.float32, device="cuda")
    (ids, positions), meta = dummy_inputs(model, cache, 4)
    report = piecegraph.doctor(model, ids, positions, context=meta)
    assert report.ok, report.json()
    assert report.pieces == TINY.num_layers + 1
