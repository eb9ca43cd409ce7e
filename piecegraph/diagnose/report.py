"""The doctor's report: a dataclass, its JSON (stable schema, validated without dependencies), rich text, HTML.

JSON schema (``SCHEMA``; ``validate`` checks a document against it): ``{"ok": bool, "torch": str, "findings":
[{"kind": "trace"|"capture", "category", "package", "entry", "loader", "loader_warm", "primitive", "location",
"count", "fix", ...}], "pieces": int, "graph_breaks": int, ...}``. Keys listed in ``required`` are always there;
other keys (``reason``, ``stack``, ``fixed``, ...) may be added in later versions, never renamed or removed.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from piecegraph.diagnose.attribute import CATEGORIES, Finding

__all__ = ["Report", "SCHEMA", "validate", "render", "to_html"]

_STR_OR_NULL = {"type": ["string", "null"]}
FINDING_SCHEMA: dict = {
    "type": "object",
    "required": ["kind", "category", "package", "entry", "loader", "loader_warm", "primitive", "location",
                 "count", "fix"],
    "properties": {
        "kind": {"type": "string", "enum": ["trace", "capture"]},
        "category": {"type": "string", "enum": list(CATEGORIES)},
        "package": {"type": "string"},
        "entry": _STR_OR_NULL,
        "loader": _STR_OR_NULL,
        "loader_warm": {"type": ["boolean", "null"]},
        "primitive": {"type": "string"},
        "location": {"type": "string"},
        "count": {"type": "integer", "minimum": 0},
        "fix": {"type": "string"},
        "reason": {"type": "string"},
        "stack": {"type": "array", "items": {"type": "string"}},
        "hard": {"type": "boolean"},
        "group": {"type": "integer", "minimum": 0},
    },
}
SCHEMA: dict = {
    "type": "object",
    "required": ["ok", "torch", "findings", "pieces", "graph_breaks"],
    "properties": {
        "ok": {"type": "boolean"},
        "torch": {"type": "string"},
        "findings": {"type": "array", "items": FINDING_SCHEMA},
        "pieces": {"type": "integer", "minimum": 0},
        "graph_breaks": {"type": "integer", "minimum": 0},
        "device": {"type": "string"},
        "seconds": {"type": "number", "minimum": 0},
        "fixed": {"type": ["object", "null"]},
        "error": _STR_OR_NULL,
    },
}
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "number": (int, float),
          "integer": int, "null": type(None)}


def _type_ok(value: Any, names: Any) -> bool:
    for name in names if isinstance(names, list) else [names]:
        if name in ("integer", "number") and isinstance(value, bool):
            continue  # JSON booleans are not numbers, though Python's are
        if isinstance(value, _TYPES[name]):
            return True
    return False


def validate(doc: Any, schema: Optional[dict] = None, path: str = "$") -> list[str]:
    """Errors of ``doc`` against ``schema`` (default :data:`SCHEMA`): the subset of JSON Schema used here."""
    schema = SCHEMA if schema is None else schema
    if "type" in schema and not _type_ok(doc, schema["type"]):
        return [f"{path}: expected {schema['type']}, got {type(doc).__name__}"]
    errors = []
    if "enum" in schema and doc not in schema["enum"]:
        errors.append(f"{path}: {doc!r} is not one of {schema['enum']}")
    if "minimum" in schema and isinstance(doc, (int, float)) and doc < schema["minimum"]:
        errors.append(f"{path}: {doc} < {schema['minimum']}")
    if isinstance(doc, dict):
        errors += [f"{path}: missing {k!r}" for k in schema.get("required", []) if k not in doc]
        for key, sub in schema.get("properties", {}).items():
            if key in doc:
                errors += validate(doc[key], sub, f"{path}.{key}")
    if isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            errors += validate(item, schema["items"], f"{path}[{i}]")
    return errors


@dataclass
class Report:
    """What :func:`piecegraph.doctor` found. ``ok`` is True only when nothing blocks tracing and capture.

    ``before`` holds the first trace's finding count when ``fix=True`` applied fixes (then ``findings`` are
    what remains); ``applied`` lists the fix code applied and can undo it (``report.applied.undo()``).
    """

    torch: str
    device: str
    findings: list[Finding] = field(default_factory=list)
    pieces: int = 0
    graph_breaks: int = 0
    seconds: float = 0.0
    error: Optional[str] = None
    before: Optional[dict] = None  # {"graph_breaks": n, "findings": n} of the first trace, when fixes applied
    applied: Any = None  # piecegraph.diagnose.fixes.Applied

    @property
    def ok(self) -> bool:
        return not self.findings and self.error is None

    def json(self) -> dict:
        fixed = None
        if self.before is not None:
            fixed = {"before": self.before, "after": {"graph_breaks": self.graph_breaks,
                                                      "findings": len(self.findings)},
                     "applied": list(getattr(self.applied, "codes", []))}
        return {"ok": self.ok, "torch": self.torch, "device": self.device,
                "findings": [f.json() for f in self.findings], "pieces": self.pieces,
                "graph_breaks": self.graph_breaks, "seconds": round(self.seconds, 3), "fixed": fixed,
                "error": self.error}

    def dumps(self) -> str:
        return json.dumps(self.json(), indent=1)


# ------------------------------------------------------------------------------------------------ terminal
def _groups(report: Report) -> list[list[Finding]]:
    groups: dict[int, list[Finding]] = {}
    for f in report.findings:
        groups.setdefault(f.group, []).append(f)
    return [groups[k] for k in sorted(groups)]


def render(report: Report, console: Any = None) -> None:
    """Print the report with rich: a summary line, then one panel per root cause, largest first."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    status = "[green]ok[/]" if report.ok else f"[red]{len(report.findings)} blocking finding(s)[/]"
    console.print(f"[bold]piecegraph doctor[/] torch {report.torch} on {report.device}: {status}; "
                  f"{report.graph_breaks} graph break(s), {report.pieces} piece(s), {report.seconds:.1f} s")
    if report.before is not None:
        console.print(f"--fix applied {len(report.applied.codes)} fix(es): graph breaks "
                      f"{report.before['graph_breaks']} -> {report.graph_breaks}, findings "
                      f"{report.before['findings']} -> {len(report.findings)}")
        for code in report.applied.codes:
            console.print(f"  [cyan]{escape(code)}[/]", highlight=False)
    if report.error:
        console.print(f"[red]tracing failed:[/] {report.error}")
    for n, group in enumerate(_groups(report), 1):
        head = group[0]
        table = Table(title=f"#{n} {head.package} ▸ {head.entry or '-'} ▸ {head.loader or 'no loader'} "
                            f"({len(group)} finding(s))", title_justify="left", show_lines=False)
        for col in ("kind", "category", "primitive", "location", "per fwd", "loader warm"):
            table.add_column(col, overflow="fold")
        for f in group:
            warm = "-" if f.loader_warm is None else ("yes" if f.loader_warm else "no")
            table.add_row(f.kind, f.category, f.primitive, f.location, str(f.count), warm)
        console.print(table)
        console.print(f"  fix: [bold cyan]{escape(head.fix)}[/]", highlight=False)


# -------------------------------------------------------------------------------------------------- HTML
_CSS = ("body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left;font-size:90%}"
        "code,pre{background:#f4f4f4;padding:.1em .3em}.ok{color:#080}.bad{color:#b00}")


def _row(f: Finding) -> str:
    cells = (f.kind, f.category, f.primitive, f.location, str(f.count), str(f.loader_warm))
    stack = html.escape("\n".join(f.stack))
    return ("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
            + f"<td><details><summary>stack</summary><pre>{stack}</pre>"
            + f"<pre>{html.escape(f.reason)}</pre></details></td></tr>")


def to_html(report: Report) -> str:
    """One self-contained HTML page (inline CSS, no scripts, no external resources)."""
    status = "<span class=ok>ok</span>" if report.ok else f"<span class=bad>{len(report.findings)} blocking</span>"
    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>piecegraph doctor</title>"
             f"<style>{_CSS}</style></head><body><h1>piecegraph doctor</h1>",
             f"<p>torch {html.escape(report.torch)} on {html.escape(report.device)}: {status}; "
             f"{report.graph_breaks} graph break(s), {report.pieces} piece(s)</p>"]
    if report.before is not None:
        parts.append(f"<p>--fix: graph breaks {report.before['graph_breaks']} &rarr; {report.graph_breaks}; "
                     + "".join(f"<br><code>{html.escape(c)}</code>" for c in report.applied.codes) + "</p>")
    if report.error:
        parts.append(f"<p class=bad>tracing failed: {html.escape(report.error)}</p>")
    for n, group in enumerate(_groups(report), 1):
        head = group[0]
        parts.append(f"<h2>#{n} {html.escape(head.package)} &#9656; {html.escape(head.entry or '-')} &#9656; "
                     f"{html.escape(head.loader or 'no loader')}</h2><p>fix: <code>{html.escape(head.fix)}</code>"
                     "</p><table><tr><th>kind</th><th>category</th><th>primitive</th><th>location</th>"
                     "<th>per forward</th><th>loader warm</th><th></th></tr>")
        parts.extend(_row(f) for f in group)
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts)
