"""The doctor: name what blocks a full-graph trace or a CUDA-graph capture, where it comes from, and the fix.

``piecegraph.doctor(model, *inputs, context=None, fix=False, device=None) -> Report`` in Python;
``piecegraph doctor TARGET [--json FILE] [--html FILE] [--fix] [--device cpu|cuda]`` on the command line.
Stages, one module each: ``trace`` (collect breaks), ``attribute`` (package ▸ entry ▸ loader ▸ primitive),
``counting`` (runs per forward), ``fixes`` (fix code, grouping, ``--fix``), ``probe`` (capture), ``report``.
"""

from piecegraph.diagnose.attribute import CATEGORIES, Finding
from piecegraph.diagnose.core import doctor
from piecegraph.diagnose.report import SCHEMA, Report, validate

__all__ = ["doctor", "Report", "Finding", "CATEGORIES", "SCHEMA", "validate"]
