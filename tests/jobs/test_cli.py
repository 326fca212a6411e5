from click.testing import CliRunner

from engine import __version__
from jobs.cli import main


def test_version_and_help():
    runner = CliRunner()
    out = runner.invoke(main, ["--version"])
    assert out.exit_code == 0 and __version__ in out.output
    out = runner.invoke(main, ["--help"])
    assert out.exit_code == 0 and "batch inference" in out.output
