"""The `batchinfer` command line."""
from __future__ import annotations

import click

from engine import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchinfer")
def main() -> None:
    """Offline batch inference for large language models."""


if __name__ == "__main__":
    main()
