"""The ``mmapckpt bench`` subcommand: the in-process comparison (bench/runner.py) or, with
``--fresh``, every load in a new process (bench/fresh.py); with ``--managed``, saves through
``CheckpointManager`` beside plain ones (bench/managed.py). The command line (tools/cli.py)
imports this module only when ``bench`` is chosen."""

from __future__ import annotations

import argparse

from . import fresh, managed, runner

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``mmapckpt bench`` options (both modes') to ``parser``."""
    runner.add_arguments(parser)
    fresh.add_fresh_arguments(parser)
    parser.add_argument("--managed", action="store_true",
                        help="the managed-saves row only: a state dict of --size, 90%% of it frozen, saved "
                             f"{managed.SAVES} times through CheckpointManager beside dcp.save + MmapWriter into "
                             "fresh directories, and a fully changing one (docs/benchmarks.md)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "managed", False):
        return runner.drive(args, managed.run)
    return fresh.run(args) if getattr(args, "fresh", False) else runner.run(args)
