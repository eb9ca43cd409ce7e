"""The types every stage shares: a traced program, its inputs, its pieces and their capture state
(:mod:`.types`), and the argument helpers of error messages and token inputs (:mod:`.arguments`).

This package sits below every stage (trace, graphs, runner) and imports only torch and the standard library, so
the data flows one way: ``trace/`` builds a :class:`Program`, ``graphs/`` captures and replays its pieces,
``runner/`` calls it. A breakable program (``graphs/breakable.py``) has the same shape without Dynamo.
"""

from .arguments import check_token_dim, describe, kept_buffers, token_arguments
from .types import ArgSpec, CaptureState, InputKind, Phase, Piece, PieceInfo, Program, TokenCountMismatch

__all__ = ["ArgSpec", "CaptureState", "InputKind", "Phase", "Piece", "PieceInfo", "Program", "TokenCountMismatch",
           "check_token_dim", "describe", "kept_buffers", "token_arguments"]
