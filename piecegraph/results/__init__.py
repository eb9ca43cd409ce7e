"""Benchmark results: the one JSON schema every runner writes (:mod:`.schema`) and reading them back as tables
and comparisons (:mod:`.report`, ``piecegraph report``). Imports nothing else from piecegraph, so every stage can
write results."""

from piecegraph.results.schema import (
    REQUIRED_ENV,
    Result,
    SchemaError,
    check,
    environment,
    gpu_short,
    load_result,
    result_name,
    write_result,
)

__all__ = ["REQUIRED_ENV", "Result", "SchemaError", "check", "environment", "gpu_short", "load_result",
           "result_name", "write_result"]
