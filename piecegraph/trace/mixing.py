"""Find the ops of a traced graph that mix rows over the token dimension, outside split ops.

Padding a call of ``n`` tokens to a capture size ``s`` is only exact when every op outside the split ops treats
tokens independently: pad rows hold values (after a Linear with bias, the bias), so a mean over tokens, a softmax
along them, a convolution over them, batch-norm statistics or attention over all tokens computed in the graph all
see them. The symbolic token count of the trace tells which dimension of every intermediate tensor is the token
dimension; an op mixes when

* a token tensor goes in and no output keeps a token dimension (a sum or mean over tokens, a scalar loss, ``x.T @
  x``, ``x[-1]``), except picking rows by a non-negative index or an index tensor; a dimension of ``k`` times
  the token count, from flattening ``[T, k]``, still is one (rows stay grouped per token);
* it concatenates or repeats along the token dimension;
* an output has two token dimensions (``q @ k.T`` over all tokens);
* it writes rows along the token dimension at per-token indices (``index_copy_``, ``index_add_``, ``scatter_``,
  ``index_put_``, ``y[idx] = v`` with an index that has a token dimension): a pad row's index can name a real
  row and overwrite (or add to) it; or
* a known shape-keeping op works along the token dimension (softmax, cumsum, sort, flip, roll, convolution and
  pooling over it, batch-norm in training, layer-norm over it, ``scaled_dot_product_attention`` over it).

Custom ops (opaque library kernels) are taken as token-wise: piecegraph cannot see inside them. So are the ops
inside a module whose class declares ``piecegraph_padding_safe = True``: its author states that pad rows never
change a real row's output there, although ops in it work along the token dimension (a capacity-free mixture of
experts sorts its (token, expert) rows by expert, yet computes every row on its own and returns it to its token).
Such a module should carry a test that appending rows leaves the real rows' outputs unchanged.
"""

from __future__ import annotations

import builtins
import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class MixingOp:
    """One op that mixes rows over the token dimension: what it is and where the model calls it."""

    op: str
    why: str
    where: str  # "file:line", or the node's name when the trace kept no stack
    code: str = ""  # the source line

    def __str__(self) -> str:
        return f"{self.op} at {self.where} ({self.why})" + (f": `{self.code}`" if self.code else "")


_ALONG_DIM = {  # op -> (position of its dim argument, default dim)
    "softmax": (1, None), "log_softmax": (1, None), "_softmax": (1, None), "cumsum": (1, None),
    "cumprod": (1, None), "cummax": (1, None), "cummin": (1, None), "logcumsumexp": (1, None),
    "sort": (1, -1), "argsort": (1, -1), "topk": (2, -1), "normalize": (2, 1), "diff": (2, -1),
    "kthvalue": (2, -1), "msort": (None, 0),
}
_SPATIAL = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
            "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
            "adaptive_avg_pool1d", "adaptive_max_pool1d", "instance_norm", "group_norm", "local_response_norm"}
_CONTRACTING = {"matmul", "mm", "bmm", "__matmul__", "linear", "addmm", "baddbmm", "einsum"}
_ROW_PICKS = {"getitem", "__getitem__", "index_select", "embedding"}
# (self, dim, index, ...) writes; in-place or not
_INDEXED_WRITES = {f"{op}{tail}" for op in ("index_copy", "index_add", "index_fill", "index_reduce", "scatter",
                                           "scatter_add", "scatter_reduce") for tail in ("", "_")}
_PUT_WRITES = {"index_put", "index_put_", "setitem", "__setitem__"}  # (self, indices, values)


def find_token_mixing(gm: torch.fx.GraphModule, token_symbols: Any) -> list[MixingOp]:
    """Every op of ``gm`` (a Dynamo graph whose token count is ``token_symbols``) outside custom ops (split ops
    and opaque kernels) that mixes rows over the token dimension (see the module docstring)."""
    found = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or _is_custom_op(node) or _declared_padding_safe(node):
            continue
        why = _mixes(node, token_symbols)
        if why:
            found.append(MixingOp(op_name(node), why, *_where(node)))
    return found


def _declared_padding_safe(node: torch.fx.Node) -> bool:
    """Whether a module around ``node`` declares ``piecegraph_padding_safe = True`` (module docstring)."""
    for value in (node.meta.get("nn_module_stack") or {}).values():
        cls = value[1] if isinstance(value, tuple) and len(value) > 1 else None
        if isinstance(cls, type) and getattr(cls, "piecegraph_padding_safe", False) is True:
            return True
    return False


def _mixes(node: torch.fx.Node, sym: Any) -> str | None:
    inputs = [(t, _token_axes(t, sym)) for t in _tensors(node.args, node.kwargs)]
    outputs = [(t, _token_axes(t, sym)) for t in _tensor_values(node.meta.get("example_value"))]
    name = op_name(node)
    if (name in _INDEXED_WRITES or name in _PUT_WRITES) and _writes_at_token_indices(node, name, sym):
        return "writes rows along the token dimension at per-token indices (a pad row's index can name a real row)"
    if not outputs or not any(axes for _, axes in inputs):
        return None
    if any(len(axes) > 1 for _, axes in outputs):
        return "its result pairs every token with every other"
    if not any(axes for _, axes in outputs):
        if name in _ROW_PICKS and _picks_rows(node, name, inputs):
            return None
        return "reduces over the token dimension"
    first, first_axes = inputs[0] if inputs else (None, [])
    if name in ("cat", "concat", "concatenate"):
        dim = _dim_arg(node, 1, 0)
        if any(_axis(dim, t.dim()) in axes for t, axes in inputs):
            return "concatenates along the token dimension"
    if name in ("repeat", "tile") and first_axes:
        reps = node.args[1:] if len(node.args) > 2 or not isinstance(node.args[1], (tuple, list)) else node.args[1]
        reps = list(reps)[-first.dim():] if reps else []
        if any(a < len(reps) and reps[a] != 1 for a in first_axes):
            return "repeats along the token dimension"
    if name in _ALONG_DIM:
        dim = _dim_arg(node, *_ALONG_DIM[name])
        if dim is None or _axis(dim, first.dim()) in first_axes:
            return "works along the token dimension"
    if name in ("flip", "roll"):
        dims = node.args[1] if name == "flip" and len(node.args) > 1 else node.kwargs.get("dims")
        if name == "roll" and len(node.args) > 2:
            dims = node.args[2]
        if dims is None or {_axis(d, first.dim()) for d in _as_tuple(dims)} & set(first_axes):
            return "moves rows along the token dimension"
    if name in _SPATIAL and any(a >= 2 for a in first_axes):
        return "convolves, pools or normalizes over the token dimension"
    if name == "batch_norm" and _batch_norm_training(node):
        return "batch statistics include every token"
    if name in ("layer_norm", "rms_norm") and first_axes:
        shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        if any(a >= first.dim() - len(_as_tuple(shape)) for a in first_axes):
            return "normalizes over the token dimension"
    if name == "scaled_dot_product_attention" and any(t.dim() >= 2 and t.dim() - 2 in axes for t, axes in inputs):
        return "attends over all tokens"
    if name in _CONTRACTING and _contracts_tokens(node, name, inputs):
        return "sums products over the token dimension"
    return None


def _writes_at_token_indices(node: torch.fx.Node, name: str, sym: Any) -> bool:
    """The destination's written dimension is a token dimension and an integer index tensor has a token
    dimension (its rows follow the tokens, so pad rows carry indices too)."""
    args = list(node.args)
    dest = _example(args[0]) if args else None
    if not isinstance(dest, torch.Tensor):
        return False
    dest_axes = _token_axes(dest, sym)
    if name in _INDEXED_WRITES:
        dim = args[1] if len(args) > 1 else node.kwargs.get("dim")
        index = args[2] if len(args) > 2 else node.kwargs.get("index")
        if not isinstance(dim, int) or _axis(dim, dest.dim()) not in dest_axes:
            return False
    else:
        key = args[1] if len(args) > 1 else node.kwargs.get("indices")
        key = key[0] if isinstance(key, (tuple, list)) and key else key
        if 0 not in dest_axes:
            return False
        index = key
    index = _example(index)  # a boolean mask writes each row in place (its own row): not a mix
    return isinstance(index, torch.Tensor) and index.dtype != torch.bool and bool(_token_axes(index, sym))


def _example(value: Any) -> Any:
    return value.meta.get("example_value") if isinstance(value, torch.fx.Node) else value


def _contracts_tokens(node: torch.fx.Node, name: str, inputs: list) -> bool:
    if name == "einsum":
        spec = node.args[0] if isinstance(node.args[0], str) else None
        if spec is None or "->" not in spec:
            return True  # an implicit output: cannot tell, assume the worst
        ins, out = spec.replace(" ", "").split("->")
        for letters, (_, axes) in zip(ins.split(","), inputs):
            letters = re.sub(r"\.\.\.", "", letters)
            if any(a < len(letters) and letters[a] not in out for a in axes):
                return True
        return False
    tensors = [t for t, _ in inputs]
    axes = [a for _, a in inputs]
    if name in ("addmm", "baddbmm"):
        tensors, axes = tensors[1:], axes[1:]
    if len(tensors) < 2:
        return False
    a, b = tensors[0], tensors[1]
    if name == "linear":
        return a.dim() - 1 in axes[0] or 1 in axes[1]  # weight [out, in]: its dim 1 is contracted
    return a.dim() - 1 in axes[0] or (b.dim() >= 2 and b.dim() - 2 in axes[1]) or (b.dim() == 1 and 0 in axes[1])


def _picks_rows(node: torch.fx.Node, name: str, inputs: list) -> bool:
    """Rows chosen by a non-negative constant or by an index tensor: the same rows padded or not (the indices
    must point at real rows, as they must without padding)."""
    if name == "embedding" or name == "index_select":
        return True
    source_axes = inputs[0][1] if inputs else []
    if source_axes != [0]:
        return False
    index = node.args[1] if len(node.args) > 1 else None
    first = index[0] if isinstance(index, tuple) and index else index
    if isinstance(first, torch.fx.Node):
        return isinstance(first.meta.get("example_value"), torch.Tensor)
    return isinstance(first, int) and first >= 0


def _batch_norm_training(node: torch.fx.Node) -> bool:
    args = list(node.args) + [None] * 8
    training = node.kwargs.get("training", args[5])
    running_mean = node.kwargs.get("running_mean", args[1])
    return bool(training) or running_mean is None


def _dim_arg(node: torch.fx.Node, position: int | None, default: int | None) -> int | None:
    if "dim" in node.kwargs:
        return node.kwargs["dim"]
    if position is not None and len(node.args) > position and isinstance(node.args[position], int):
        return node.args[position]
    return default


def _axis(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _as_tuple(value: Any) -> tuple:
    if isinstance(value, (list, tuple, torch.Size)):
        return tuple(value)
    return (value,)


def _token_axes(t: torch.Tensor, sym: Any) -> list[int]:
    """Axes whose size is the token count, or a multiple of it (``[T, K]`` flattened to ``[T * K]``: rows stay
    grouped per token, so later ops on it are still followed)."""
    return [i for i, s in enumerate(t.shape) if isinstance(s, torch.SymInt) and _is_token_size(s.node.expr, sym)]


def _is_token_size(expr: Any, sym: Any) -> bool:
    if expr in sym:
        return True
    coeff, rest = expr.as_coeff_Mul() if hasattr(expr, "as_coeff_Mul") else (None, None)
    return rest in sym and getattr(coeff, "is_Integer", False) and coeff > 0


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    out = []
    for a in tree_flatten((args, kwargs))[0]:
        if isinstance(a, torch.fx.Node):
            out.extend(_tensor_values(a.meta.get("example_value")))
    return out


def _tensor_values(value: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]


def op_name(node: torch.fx.Node) -> str:
    """The short name of a call node's op: a method's name, ``getitem``, ``matmul``, the attribute of a
    ``getattr`` (``T``, ``mT``), else the function's ``__name__`` (last dotted part)."""
    if node.op == "call_method":
        return str(node.target)
    if node.target is operator.getitem:
        return "getitem"
    if node.target is operator.matmul:
        return "matmul"
    if node.target is builtins.getattr and len(node.args) > 1:
        return str(node.args[1])
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[-1]


def _is_custom_op(node: torch.fx.Node) -> bool:
    """A ``torch.ops`` op: split ops (which see only the real rows) and opaque library kernels, whose insides
    piecegraph cannot see."""
    return isinstance(node.target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload))


def _where(node: torch.fx.Node) -> tuple[str, str]:
    """``("file.py:line", "the code")`` of the model's line that made ``node`` (the last frame Dynamo kept)."""
    stack = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [i for i, line in enumerate(stack) if line.strip().startswith("File ")]
    if not frames:
        return node.name, ""
    line = stack[frames[-1]].strip()
    match = re.match(r'File "([^"]+)", line (\d+)', line)
    code = stack[frames[-1] + 1].strip() if frames[-1] + 1 < len(stack) else ""
    return (f"{match.group(1).rsplit('/', 1)[-1]}:{match.group(2)}" if match else line), code
