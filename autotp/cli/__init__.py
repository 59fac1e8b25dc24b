"""The ``autotp`` command line (also ``python -m autotp``)."""

from autotp.cli.main import main

__all__ = ["main"]
