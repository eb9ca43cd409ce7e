"""Doctor internals on CPU: log parsing, categories, capture-failure naming and node bisection (capture faked)."""

import torch

from piecegraph.diagnose import probe
from piecegraph.diagnose.attribute import categorize, primitive_of
from piecegraph.diagnose.trace import parse_record

_MESSAGE = '''Graph break in user code at /src/lib/ops.py:12
Graph Break Reason: Encountered graph break when attempting to trace CALL: a function call, e.g. f(x, y):

Attempted to call function marked as skipped
  Explanation: Dynamo does not know how to trace the builtin `posix.stat.` This function is either ...
  Hint: If it is a Python builtin, please file an issue

User code traceback:
  File "/src/run.py", line 3, in <module>
    main()

========== most recent `torch.compile` tracing attempt started here ==========

  File "/src/model.py", line 8, in forward
    y = lib.op(x)
  File "/src/lib/ops.py", line 12, in torch_dynamo_resume_in_op_at_10
    os.stat(path)

NOTE: the most recent `torch.compile` tracing attempt might not be where you applied `torch.compile`!
'''


def test_parse_record_keeps_user_frames_and_reason():
    record = parse_record(_MESSAGE)
    assert record is not None and not record.hard
    assert record.reason.startswith("Attempted to call function marked as skipped")
    assert [(f.file, f.line, f.name) for f in record.stack] == [
        ("/src/run.py", 3, "<module>"), ("/src/model.py", 8, "forward"), ("/src/lib/ops.py", 12, "op")]
    assert record.stack[-1].code == "os.stat(path)"
    assert primitive_of(record.reason) == "posix.stat"


def test_parse_record_of_a_suppressed_duplicate_and_of_other_messages():
    record = parse_record("Graph break (user stack suppressed due to duplicate graph break) in user code at "
                          "/src/a.py:5\nGraph Break Reason: Data-dependent branching")
    assert record.stack[0].location == "/src/a.py:5" and primitive_of(record.reason) == "bool(tensor)"
    assert parse_record("Restarting analysis due to ...") is None


def test_categories_from_primitive_stack_and_reason():
    assert categorize("subprocess.run (_thread.allocate_lock)", "", ["subprocess"], "_thread") == "subprocess"
    assert categorize("pathlib.Path.exists (posix.stat)", "", ["pathlib"], "posix") == "filesystem"
    assert categorize("_thread.allocate_lock", "", [], "_thread") == "lock"
    assert categorize("time.monotonic", "", [], "time") == "clock"
    assert categorize("open", "", [], None) == "file_io"
    assert categorize("print", "", [], None) == "print_logging"
    assert categorize("Tensor.item", "Unsupported Tensor.item() call", [], None) == "data_dependent"
    assert categorize("mylib._C.rmsnorm", "", [], "mylib._C") == "ffi_call"  # a pybind / tvm-ffi builtin
    assert categorize("gc.collect", "", [], "gc") == "unsupported_builtin"
    assert categorize("Generator.random", "attempted to trace numpy function", [], None) == "numpy"
    # Dynamo's hints mention `_warnings.warn` and `print` for every skipped builtin: they must not count
    hint = "builtin `sys.getsizeof.` ... a Python builtin (e.g. _warnings.warn) ... logging function (e.g. `print`)"
    assert categorize("sys.getsizeof", hint, [], "sys") == "unsupported_builtin"


def test_capture_failures_are_named():
    why = probe.why_capture_fails
    assert why("streams.synchronize_device.default", "operation not permitted").startswith("device sync")
    assert why("torch.cuda.synchronize", "").startswith("device sync")
    assert why("Tensor.item", "operation not permitted when stream is capturing").startswith(".item()")
    assert why("Tensor.to", "", {"device": "cpu"}).startswith(".item()")
    assert why("torch.empty", "", {"pin_memory": True}).startswith("pinned or host")
    assert why("aten.add", "cudaErrorStreamCaptureUnjoined: capture unjoined").startswith("unjoined side stream")
    assert why("torch.randn", "").startswith("RNG state")
    assert why("aten.mm", "CUDA error: an illegal memory access") == "CUDA error: CUDA error: an illegal memory access"


class _Piece(torch.nn.Module):
    def forward(self, x):
        a = x * 2
        b = a + 1
        c = b.sum()
        d = torch.relu(b)
        return d * c


def test_bisection_finds_the_first_node_that_breaks_capture(monkeypatch):
    gm = torch.fx.symbolic_trace(_Piece())

    def fake_capture(fn, args):  # "capture" fails once the prefix holds the sum (a stand-in for .item())
        fn(*args)  # the prefix must still run
        names = [n.name for n in fn.graph.nodes]
        return "operation not permitted when stream is capturing" if "sum_1" in names else None

    monkeypatch.setattr(probe, "_try_capture", fake_capture)
    node, error = probe._bisect(gm, [torch.randn(3)])
    assert node is not None and node.name == "sum_1" and "capturing" in error


def test_count_pieces_splits_at_split_ops():
    gm = torch.fx.symbolic_trace(_Piece())
    assert probe.count_pieces(gm) == 1


class _LayerWithABreak(torch.nn.Module):
    """A library call that breaks Dynamo, then the layer's own index read after it (in a resume function, which
    Dynamo guards on that constant: one recompile per layer, as the reference decoder's ``layer_idx``)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.layer_idx = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        torch._dynamo.graph_break()
        return x + self.layer_idx


def test_a_diagnosis_trace_holds_back_dynamos_recompile_limit_warning_and_only_it():
    """12 layers > Dynamo's recompile limit of 8: the doctor's trace keeps the limit (the later layers are the same
    code, the breaks are counted by running the model) without printing Dynamo's warning, which reads like a
    failure; outside the diagnosis the warning, and the logger, are as they were."""
    import logging

    from piecegraph.diagnose.trace import trace

    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("torch._dynamo.convert_frame")
    handler = _Keep(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        result = trace(torch.nn.Sequential(*(_LayerWithABreak(i) for i in range(12))), (torch.ones(3, 4),))
        assert result.error is None and len(result.breaks) >= 1
        assert not [m for m in seen if "recompile_limit" in m]
        torch._dynamo.reset()
        compiled = torch.compile(torch.nn.Sequential(*(_LayerWithABreak(i) for i in range(12))), backend="eager")
        compiled(torch.ones(3, 4))
        assert [m for m in seen if "recompile_limit" in m]  # the same model outside a diagnosis: Dynamo's warning
    finally:
        logger.removeHandler(handler)
        torch._dynamo.reset()
    assert not logger.filters
