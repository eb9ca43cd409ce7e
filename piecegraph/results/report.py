"""Reading result files: one file's rows as a table, two files compared row by row (A, B and B/A).

Rows of two files are matched on their *key columns*: the columns that say which cell a row is (``mode``,
``phase``, ``batch``, ``tokens``, ``concurrency``, ...), not what was measured in it. A column is a key when it
holds strings (free text such as ``note`` or ``skipped``, and dotted parts such as ``piecewise.trace``, aside)
or is one of :data:`KEY_NUMBERS`, the integer columns that name a cell; ``key=`` overrides the choice. Every
other column whose values are numbers is a measurement: compared as A, B and B/A. ``piecegraph report``
(``cli.py``) prints these tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from piecegraph.results.schema import NAME, Result, gpu_short, result_name

# Integer columns that name a cell rather than measure it
KEY_NUMBERS = ("batch", "tokens", "concurrency", "size", "rows", "context", "layers", "tp", "repeat")
# String columns that describe a cell rather than name it: never keys
FREE_TEXT = ("note", "skipped", "error", "reason", "verdict", "command", "why", "message", "how", "line", "aot")
# The columns a comparison shows when none are asked for, per benchmark (else every measurement)
DEFAULT_COMPARE = {"bench": ("ms",), "serve-bench": ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")}


def is_scalar(value: Any) -> bool:
    """Whether ``value`` fits one table cell: null, a string, a number or a boolean."""
    return value is None or isinstance(value, (str, int, float, bool))


def is_number(value: Any) -> bool:
    """Whether ``value`` is an int or a float (a boolean is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def columns_of(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Every key of ``rows`` in first-seen order."""
    return list(dict.fromkeys(k for row in rows for k in row))


def scalar_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The columns whose values are all scalars (nested objects and lists are left to the JSON)."""
    return [c for c in columns_of(rows) if all(is_scalar(row.get(c)) for row in rows)]


def key_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The columns that name a row's cell (module docstring), in column order."""
    out = []
    for c in scalar_columns(rows):
        values = [row[c] for row in rows if row.get(c) is not None]
        # a dotted column is a part of a measurement (``piecewise.trace``), never a key
        if c in KEY_NUMBERS or (c not in FREE_TEXT and "." not in c and any(isinstance(v, str) for v in values)):
            out.append(c)
    return out


def measure_columns(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[str]:
    """The non-key columns holding numbers (and nothing but numbers or ``null``)."""
    return [c for c in scalar_columns(rows) if c not in keys
            and any(is_number(row.get(c)) for row in rows)
            and all(row.get(c) is None or is_number(row.get(c)) for row in rows)]


def fmt(value: Any) -> str:
    """A cell: ``-`` for null, 4 significant digits for floats (thousands separated above 1,000)."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, float):
        return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.1f}"
    if size >= 1 or size == 0:
        return f"{value:.3g}" if size >= 10 else f"{value:.3f}"
    return f"{value:.3g}"


def describe(result: Result) -> str:
    """One line naming the run: benchmark, device, versions, model, date, commit."""
    env = result.env
    model = " ".join(str(env[k]) for k in ("model", "dtype") if env.get(k))
    quant = f" {env['quant']}" if env.get("quant") not in (None, "bf16") else ""
    ranks = f" x{env['world_size']} (tp)" if env.get("world_size", 1) > 1 else ""
    attention = f", {env['attention']} attention" if env.get("attention") else ""
    flashinfer = f", FlashInfer {env['flashinfer']}" if env.get("flashinfer") else ""
    commit = f", commit {env['commit']}" if env.get("commit") else ""
    return (f"{result.benchmark}: {model or 'no model'}{quant} on {env['gpu']}{ranks}, torch {env['torch']}"
            f"{flashinfer}{attention}, {env['date']}{commit}")


def rows_table(result: Result, columns: Sequence[str] | None = None, title: str | None = None) -> Table:
    """Every row of ``result``; the columns are the rows' scalar keys (or ``columns``, in that order)."""
    shown = list(columns) if columns else scalar_columns(result.rows)
    table = Table(title=title if title is not None else describe(result))
    for c in shown:
        table.add_column(c, justify="right" if any(is_number(r.get(c)) for r in result.rows) else "left",
                         overflow="fold", max_width=48)
    for row in result.rows:
        table.add_row(*(fmt(row.get(c)) if is_scalar(row.get(c)) else "…" for c in shown))
    return table


def hidden_columns(result: Result) -> list[str]:
    """The columns :func:`rows_table` leaves out by default: those holding objects or lists."""
    shown = set(scalar_columns(result.rows))
    return [c for c in columns_of(result.rows) if c not in shown]


def ratio(a: Any, b: Any) -> float | None:
    """``b / a`` for two numbers with ``a`` non-zero, else ``None``."""
    return b / a if is_number(a) and is_number(b) and a else None


@dataclass
class Comparison:
    """Two results' rows matched on ``keys``: ``matched`` holds ``(key values, row of A, row of B)``, ``only_a`` /
    ``only_b`` the key values found in one file only; ``columns`` are the measurements compared."""

    keys: list[str]
    columns: list[str]
    matched: list[tuple[tuple, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    only_a: list[tuple] = field(default_factory=list)
    only_b: list[tuple] = field(default_factory=list)

    def ratios(self, column: str) -> dict[tuple, float | None]:
        """Key values -> B/A of ``column`` for every matched row."""
        return {k: ratio(a.get(column), b.get(column)) for k, a, b in self.matched}


def compare(a: Result, b: Result, columns: Sequence[str] | None = None,
            key: Sequence[str] | None = None) -> Comparison:
    """Match ``a``'s and ``b``'s rows on their key columns (``key``, else :func:`key_columns` of both files' rows)
    and pick the measurements to compare: ``columns``, else :data:`DEFAULT_COMPARE` of the benchmark where both
    files have those columns, else every measurement both have. A key value seen twice in one file keeps its first
    row. Raises ``ValueError`` naming a ``key`` or ``columns`` entry that neither file has, and when no row of one
    file matches a row of the other (two benchmarks' files, or keys that tell every row apart)."""
    both = a.rows + b.rows
    known = set(columns_of(both))
    for name in (*(key or ()), *(columns or ())):
        if name not in known:
            raise ValueError(f"no column {name!r} in either file; columns: {', '.join(columns_of(both))}")
    keys = list(key) if key else key_columns(both)
    common = [c for c in measure_columns(both, keys)
              if any(c in r for r in a.rows) and any(c in r for r in b.rows)]
    if columns:
        chosen = list(columns)
    else:
        preferred = [c for c in DEFAULT_COMPARE.get(a.benchmark, ()) if c in common]
        chosen = preferred if preferred and a.benchmark == b.benchmark else common
    out = Comparison(keys, chosen)

    def index(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
        found: dict[tuple, dict[str, Any]] = {}
        for row in rows:
            found.setdefault(tuple(row.get(k) for k in keys), row)
        return found

    rows_a, rows_b = index(a.rows), index(b.rows)
    for k, row in rows_a.items():
        if k in rows_b:
            out.matched.append((k, row, rows_b[k]))
        else:
            out.only_a.append(k)
    out.only_b = [k for k in rows_b if k not in rows_a]
    if not out.matched and a.rows and b.rows:  # an empty table would read as "nothing to compare"
        raise ValueError(f"no row of A ({a.benchmark}) matches a row of B ({b.benchmark}) on {', '.join(keys)}: "
                         "compare two runs of the same benchmark, or name the columns to match on with --key")
    return out


def compare_table(comparison: Comparison, title: str = "") -> Table:
    """The matched rows: key columns, then per measurement ``A``, ``B`` and ``B/A``."""
    table = Table(title=title)
    for k in comparison.keys:
        table.add_column(k)
    for c in comparison.columns:
        for suffix in ("A", "B", "B/A"):
            table.add_column(f"{c} {suffix}", justify="right")
    for k, a, b in comparison.matched:
        cells = []
        for c in comparison.columns:
            r = ratio(a.get(c), b.get(c))
            cells += [fmt(a.get(c)), fmt(b.get(c)), "-" if r is None else f"{r:.3f}"]
        table.add_row(*(fmt(v) for v in k), *cells)
    return table


def report_lines(results: Sequence[Result], columns: Sequence[str] | None = None,
                 key: Sequence[str] | None = None) -> list[Any]:
    """What ``piecegraph report`` prints for one file (its env line and rows) or two (both env lines and the
    comparison, then the key values found in one file only): rich tables and strings, in order. More than two
    files is a ``ValueError``."""
    if len(results) == 1:
        result = results[0]
        out: list[Any] = [rows_table(result, columns)]
        hidden = [] if columns else hidden_columns(result)
        if hidden:
            out.append(f"not shown (objects or lists; see the JSON or name them with --columns): {', '.join(hidden)}")
        if result.extra:
            out.append(f"extra keys: {', '.join(result.extra)}")
        return out
    if len(results) != 2:
        raise ValueError(f"report takes one file (its rows) or two (compared); got {len(results)}")
    a, b = results
    comparison = compare(a, b, columns, key)
    out = [f"A = {a.path or 'A'}: {describe(a)}", f"B = {b.path or 'B'}: {describe(b)}",
           compare_table(comparison, f"rows matched on {', '.join(comparison.keys) or '(no key columns)'}")]
    for label, missing in (("A", comparison.only_a), ("B", comparison.only_b)):
        if missing:
            shown = "; ".join(", ".join(fmt(v) for v in k) for k in missing[:20])
            more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
            out.append(f"only in {label}: {shown}{more}")
    return out


# The start of a new run's file name per benchmark (``default_what``); other benchmarks start with their own name
WHAT_PREFIX = {"bench": "bench_modes", "serve-bench": "serve"}
DEFAULT_MODEL = "qwen2.5-0.5b"  # the GPU runs' model, left out of the name


def default_what(result: Result) -> str:
    """The ``what`` of a new run's file name: :data:`WHAT_PREFIX` of the benchmark, then the model where it is not
    the default 0.5B shape, the attention backend, the quantization other than bf16 and ``tp<N>`` for several
    ranks, e.g. ``bench_modes_flashinfer`` or ``serve_qwen1-5-moe-a2-7b_flashinfer_fp8``."""
    env = result.env
    parts = [WHAT_PREFIX.get(result.benchmark, result.benchmark)]
    if env.get("model") and env["model"] != DEFAULT_MODEL:
        parts.append(str(env["model"]).replace(".", "-"))
    if env.get("attention"):
        parts.append(str(env["attention"]))
    if env.get("quant") not in (None, "bf16"):
        parts.append(str(env["quant"]))
    if env.get("world_size", 1) > 1:
        parts.append(f"tp{env['world_size']}")
    return "_".join(parts)


def canonical_name(result: Result, what: str | None = None) -> str:
    """The file name ``result`` is committed under (:func:`~piecegraph.results.schema.result_name`) with ``what``;
    without it, the file's own name where that already follows the pattern for its date and GPU, else
    :func:`default_what`."""
    if what is None and result.path is not None:
        match = NAME.fullmatch(result.path.name)
        if match and match["date"] == result.env["date"] and match["gpu"] == gpu_short(str(result.env["gpu"])):
            return result.path.name
    return result_name(result.env, what or default_what(result))
