"""The ``mmapckpt bench`` subcommand: the in-process comparison (bench/runner.py) or, with
``--fresh``, every load in a new process (bench/fresh.py). The command line (tools/cli.py)
imports this module only when ``bench`` is chosen."""

from __future__ import annotations

import argparse

from . import fresh, runner

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``mmapckpt bench`` options (both modes') to ``parser``."""
    runner.add_arguments(parser)
    fresh.add_fresh_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return fresh.run(args) if getattr(args, "fresh", False) else runner.run(args)
