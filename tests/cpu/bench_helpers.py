"""What the bench test files share: one CLI runner and the signature a written PNG starts with."""

from typer.testing import CliRunner

runner = CliRunner()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
