"""``piecegraph serve``'s command line without starting an engine: ``--help`` and an import that stays light, the
artifact cache, ``--full-compile``, ``--share-trace`` and ``--mixed-graphs``, ``--api-servers`` and a taken
``--port`` reaching or refused before the engine process, and the HTTP stack naming the C parts it misses."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def test_serve_command_help_and_import_stays_light():
    from typer.testing import CliRunner

    from piecegraph.cli import app

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0 and "--hf" in result.output
    code = ("import sys, piecegraph, piecegraph.cli\n"
            "print(any(m.startswith(('fastapi', 'uvicorn')) for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize("flag, expected", [([], True), (["--cache"], True), (["--no-cache"], False)])
def test_serve_keeps_compiled_code_in_the_artifact_cache_unless_told_not_to(flag, expected, monkeypatch):
    from typer.testing import CliRunner

    from piecegraph.cli import app
    from piecegraph.server import run

    seen = {}

    def stop(factory, *args, **kwargs):  # the engine's config, as the engine process would get it
        seen["config"] = factory.args[-1]
        raise SystemExit(0)

    monkeypatch.setattr(run, "build_process_state", stop)
    result = CliRunner().invoke(app, ["serve", "--model", "tiny", "--device", "cpu", *flag])
    assert result.exit_code == 0, result.output
    assert seen["config"].cache_dir is expected
    assert (seen["config"].full_compile, seen["config"].share_trace) == ("auto", True)


def test_serve_full_compile_share_trace_and_mixed_graphs_reach_the_engine_and_a_wrong_value_is_refused(
        monkeypatch):
    from typer.testing import CliRunner

    from piecegraph.cli import app
    from piecegraph.server import run

    seen = {}

    def stop(factory, *args, **kwargs):
        seen["config"] = factory.args[-1]
        raise SystemExit(0)

    monkeypatch.setattr(run, "build_process_state", stop)
    result = CliRunner().invoke(app, ["serve", "--model", "tiny", "--device", "cpu", "--full-compile", "pieces",
                                      "--no-share-trace"])
    assert result.exit_code == 0 and seen["config"].full_compile == "pieces", result.output
    assert not seen["config"].share_trace and seen["config"].mixed_graphs
    plain = CliRunner().invoke(app, ["serve", "--model", "tiny", "--device", "cpu", "--no-mixed-graphs"])
    assert plain.exit_code == 0 and not seen["config"].mixed_graphs, plain.output
    shared = CliRunner().invoke(app, ["serve", "--model", "tiny", "--device", "cpu", "--full-compile", "whole"])
    assert shared.exit_code == 0 and seen["config"].share_trace, shared.output
    assert seen["config"].full_compile == "whole"
    wrong = CliRunner().invoke(app, ["serve", "--model", "tiny", "--device", "cpu", "--full-compile", "halves"])
    assert wrong.exit_code == 2 and "--full-compile" in wrong.output and "halves" in wrong.output, wrong.output


def test_serve_api_servers_reach_the_engine_process_and_bad_ones_are_refused(monkeypatch):
    """--api-servers N gives the engine process N front ends; with --engine-thread it is refused naming the
    option; a port already taken fails before the engine's start-up, naming --port."""
    import socket

    from typer.testing import CliRunner

    from piecegraph.cli import app
    from piecegraph.server import run

    seen = {}

    def stop(factory, *args, **kwargs):
        seen["frontends"] = kwargs["frontends"]
        raise SystemExit(0)

    monkeypatch.setattr(run, "build_process_state", stop)
    base = ["serve", "--model", "tiny", "--device", "cpu", "--port", "0"]
    result = CliRunner().invoke(app, [*base, "--api-servers", "3"])
    assert result.exit_code == 0, result.output
    assert seen["frontends"] == 3
    result = CliRunner().invoke(app, [*base])
    assert result.exit_code == 0 and seen["frontends"] == 1  # the default on CPU
    result = CliRunner().invoke(app, [*base, "--api-servers", "2", "--engine-thread"])
    assert result.exit_code != 0 and "--api-servers" in result.output and "engine-process" in result.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, [*base[:-1], str(port)])
    assert result.exit_code != 0 and "--port" in result.output and f"127.0.0.1:{port}" in result.output


def test_http_stack_names_the_missing_c_parts(monkeypatch):
    """`piecegraph serve` says when uvicorn would run on its pure-Python loop or parser, and how to get the C ones."""
    import importlib.machinery
    import importlib.util

    from piecegraph.server.run import http_stack

    # uvloop present, httptools missing (whatever this machine has: a spec object stands for an installed package)
    present = importlib.machinery.ModuleSpec("uvloop", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "httptools" else present)
    stack, hint = http_stack()
    assert stack == "uvloop + h11" and "httptools" in hint and "uvloop" not in hint and "[server]" in hint
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    stack, hint = http_stack()
    assert stack == "asyncio + h11" and "uvloop and httptools" in hint
