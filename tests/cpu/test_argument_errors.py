"""Argument errors as a new user meets them: each names the argument and what it accepts, and describes a tensor
by its shape and dtype, never by its values."""

import re

import pytest
import torch
from typer.testing import CliRunner

import piecegraph
from piecegraph import Config
from piecegraph.cli import app

NO_VALUES = re.compile(r"tensor\(\[|tensor\(\d")  # how torch prints a tensor's values


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _compiled(**options):
    return piecegraph.compile(Scale(), mode="none", compiler="eager", prewarm=False, **options)


# -- (a) a scalar where a sequence is expected -----------------------------------------------------------------
def test_one_int_as_capture_sizes_names_the_field_and_what_it_takes():
    for make in (lambda: piecegraph.compile(Scale(), capture_sizes=8), lambda: Config(capture_sizes=8)):
        with pytest.raises(ValueError, match=r"capture_sizes=8 must be a list of positive ints, e\.g\. "
                                             r"capture_sizes=\(8,\) for one size"):
            make()


def test_split_ops_not_a_list_names_the_field():
    with pytest.raises(ValueError, match=r"split_ops=8 must be a list of split ops \('namespace::name' strings"):
        Config(split_ops=8)
    with pytest.raises(ValueError, match=r"split_ops entry 8 is not a split op"):
        Config(split_ops=[8])


def test_one_split_op_may_be_given_alone():
    assert Config(split_ops="mylib::attention").split_ops == ("mylib::attention",)
    assert Config(split_ops=torch.ops.aten.relu).split_ops == (torch.ops.aten.relu,)
    assert piecegraph.compile(Scale(), split_ops="mylib::attention").config.split_ops == ("mylib::attention",)


def test_static_inputs_not_a_list_names_what_it_takes():
    with pytest.raises(ValueError, match=r"static_inputs=8 must be a list of argument names, e\.g\. "
                                         r"static_inputs=\('memory',\)"):
        Config(static_inputs=8)


# -- (b) a capture callback of the wrong shape -----------------------------------------------------------------
@pytest.mark.parametrize("make_inputs,needle", [
    (lambda n: torch.zeros(n, 4), r"make_inputs\(2\) returned tensor\(shape=\(2, 4\), dtype=float32, device=cpu\); "
                                  r"it must return \(args, context\)"),
    (lambda n: (torch.zeros(n, 4), None), r"make_inputs\(2\) returned args tensor\(shape=\(2, 4\), dtype=float32, "
                                          r"device=cpu\); args must be a tuple \(or list\)"),
    (lambda n: ((torch.zeros(n, 4),),), r"make_inputs\(2\) returned \(\(tensor\(shape=\(2, 4\).*\),\),\); it must "
                                        r"return \(args, context\)"),
])
def test_capture_callback_of_the_wrong_shape_is_refused(make_inputs, needle):
    graphed = _compiled(capture_sizes=(2,))
    with pytest.raises(TypeError, match=needle) as err:
        graphed.capture(make_inputs)
    assert not NO_VALUES.search(str(err.value))


def test_capture_callback_with_the_wrong_token_count_names_the_size_asked():
    graphed = _compiled(capture_sizes=(2, 4))
    with pytest.raises(ValueError, match=r"make_inputs\(4\) returned x as tensor\(shape=\(5, 3\), dtype=float32, "
                                         r"device=cpu\): its dim token_dim=0 is 5, not 4"):
        graphed.capture(lambda n: ((torch.ones(n + 1, 3),), None))


# -- (c) a token_dim beyond the inputs' dimensions -------------------------------------------------------------
def test_token_dim_beyond_every_input_is_refused_naming_the_input():
    graphed = _compiled(token_dim=2)
    with pytest.raises(ValueError, match=r"token_dim=2 is beyond the inputs' dimensions: input 'x' has shape "
                                         r"\(4, 3\) \(dims 0\.\.1\)"):
        graphed(torch.ones(4, 3))
    x = torch.ones(2, 5, 3)  # a token_dim the input has still runs
    assert torch.equal(graphed(x), x * 2)


def test_token_dim_beyond_every_input_is_refused_by_the_dynamo_backend():
    compiled = torch.compile(Scale(), backend="piecegraph", dynamic=False,
                             options={"mode": "none", "compiler": "eager", "token_dim": 2})
    with pytest.raises(Exception, match=r"token_dim=2 is beyond the inputs' dimensions"):
        compiled(torch.ones(4, 3))


# -- (d) no error message prints a tensor's values --------------------------------------------------------------
def test_describe_gives_shape_and_dtype_never_values():
    from piecegraph.program import describe

    assert describe((torch.zeros(8, 16), None)) == "(tensor(shape=(8, 16), dtype=float32, device=cpu), None)"
    assert describe({"w": torch.arange(1000)}) == "{'w': tensor(shape=(1000,), dtype=int64, device=cpu)}"
    assert describe([[[torch.ones(3)]]]) == "[[a list of 1]]"
    assert describe(list(range(20))).endswith("... 12 more]")
    assert len(describe("x" * 1000)) == 80


def test_config_errors_describe_a_tensor_value():
    for field in ("capture_sizes", "token_dim", "copy_outputs", "verify_tol"):
        with pytest.raises(ValueError, match=rf"{field}=tensor\(shape=\(3,\), dtype=float32") as err:
            Config(**{field: torch.ones(3)})
        assert not NO_VALUES.search(str(err.value))


class WithOptions(torch.nn.Module):
    def forward(self, x: torch.Tensor, opts: dict) -> torch.Tensor:
        return x * opts["w"]


def test_tensors_inside_a_dict_argument_are_refused_by_name_without_values():
    graphed = piecegraph.compile(WithOptions(), mode="none", compiler="eager", prewarm=False)
    with pytest.raises(TypeError, match=r"argument opts=\{'w': tensor\(shape=\(3,\), dtype=float32, device=cpu\)\} "
                                        r"holds tensors inside a dict") as err:
        graphed(torch.ones(2, 3), {"w": torch.full((3,), 2.0)})
    assert not NO_VALUES.search(str(err.value))


def test_kv_cache_and_metadata_errors_describe_tensors_by_shape_not_values():
    from piecegraph.attention import AttentionMetadata, KVCache
    from piecegraph.models import TINY

    with pytest.raises(ValueError, match=r"num_pages must be a positive int, got tensor\(shape=\(3,\)") as err:
        KVCache(TINY, torch.arange(3.0))
    assert not NO_VALUES.search(str(err.value))
    cache = KVCache(TINY, 8)
    with pytest.raises(ValueError, match=r"num_cached=tensor\(shape=\(2,\), dtype=int64") as err:
        AttentionMetadata.for_batch(cache, [("a", torch.tensor([5, 6]), 1)])
    assert not NO_VALUES.search(str(err.value))


# -- (e) bad command-line values: one usage error naming the option, exit code 2 ---------------------------------
@pytest.mark.parametrize("args,needle", [
    (["demo", "--device", "nonsense"], "Invalid value for --device: 'nonsense' is not one of auto, cpu, cuda"),
    (["bench", "--device", "nonsense"], "Invalid value for --device: 'nonsense' is not one of auto, cpu, cuda"),
    (["serve-bench", "--device", "cuda:1"], "Invalid value for --device: 'cuda:1' is not one of auto, cpu, cuda"),
    (["bench", "--device", "cpu", "--batches", "abc"], "Invalid value for --batches: 'abc': expected positive ints "
                                                       "like 1,10,256"),
    (["bench", "--device", "cpu", "--batches", "0"], "Invalid value for --batches: '0': expected positive ints "
                                                     "like 1,10,256"),
])
def test_bad_cli_values_are_one_usage_error(args, needle):
    result = CliRunner().invoke(app, args)
    lines = [line.strip("│ ") for line in result.output.splitlines()]
    assert result.exit_code == 2, result.output
    assert needle in lines, result.output  # the message fits on one line
    assert "Traceback" not in result.output and not isinstance(result.exception, RuntimeError)

