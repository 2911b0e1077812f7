"""The ``mmapckpt`` command line: ``main(argv) -> int``.

Subcommands: demo, inspect, verify, convert, bench. ``demo`` and ``bench`` live in
their own modules (bench/demo.py, bench/runner.py: ``add_arguments(parser)`` and ``run(args)``),
imported only when that subcommand is chosen, so a broken one affects only itself.
Errors print one line, ``mmapckpt: error: ...``, on stderr and return non-zero;
``--debug`` shows the traceback instead.

Exit codes: 0 success; 1 an error, or ``verify`` found problems; 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import warnings
from typing import Any, Callable, Sequence

__all__ = ["main", "build_parser", "COMMANDS"]

PROG = "mmapckpt"
FORMATS = ("mmapckpt", "dcp", "safetensors", "torch")
#: subcommand -> one-line help; the lazily imported ones map to their module.
COMMANDS = {
    "demo": "save and load a small model with mmapckpt, side by side with stock DCP",
    "inspect": "show a checkpoint's format, version and entries (any supported format)",
    "verify": "check an mmapckpt checkpoint completely: metadata, headers, bounds, checksums",
    "convert": "convert between mmapckpt, stock DCP, safetensors and torch.save",
    "bench": "benchmark mmapckpt against stock DCP and safetensors",
}
# Imported by name when chosen: tools/ is the top wing, so these are imports downward (bench/).
_LAZY = {"demo": "mmapckpt.bench.demo", "bench": "mmapckpt.bench.runner"}


class _UsageExit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _version() -> str:
    from .. import __version__
    return __version__


def _add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the full traceback on errors")


def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The argument parser; ``command``'s module is imported if it is a lazy one.

    Returns the parser and {lazy command: why it could not be loaded}.
    """
    parser = argparse.ArgumentParser(prog=PROG, description="Fast, safe PyTorch distributed checkpoints: "
                                     "inspect, verify and convert them.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    broken: dict[str, str] = {}
    for name, help_ in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        _add_debug(p)
        if name in _LAZY:
            if name == command:
                broken.update(_add_lazy(name, p))
            continue
        {"inspect": _args_inspect, "verify": _args_verify, "convert": _args_convert}[name](p)
    return parser, broken


def _add_lazy(name: str, p: argparse.ArgumentParser) -> dict[str, str]:
    try:
        mod = importlib.import_module(_LAZY[name])
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
        return {}
    except Exception as e:  # a missing or broken module disables this subcommand only
        return {name: f"the {name!r} command is unavailable: {type(e).__name__}: {e}"}


def _args_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="checkpoint directory (mmapckpt or DCP), .safetensors file or index "
                   "directory, or torch.save file; or a URL of one (scheme://...)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(_run=_run_inspect)


def _args_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="mmapckpt checkpoint directory (or a safetensors or torch.save checkpoint: what "
                   "its format allows); or a URL of one (scheme://...)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print only problems: nothing, and exit 0, on a sound checkpoint")
    p.set_defaults(_run=_run_verify)


def _args_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="source checkpoint (format detected); a path or a URL (scheme://...)")
    p.add_argument("dst", help="destination (directory for mmapckpt, dcp and sharded safetensors; else a file); "
                   "a path or a URL, written through its storage")
    p.add_argument("--to", required=True, choices=FORMATS, help="target format")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="safetensors only: write Hugging Face-style shards of at most SIZE (e.g. 5GB, 500MiB) "
                   "with model.safetensors.index.json")
    p.add_argument("--keys", metavar="PATTERN", action="append",
                   help="convert only entries whose stored name matches this glob (repeatable; case-sensitive, "
                   "'*' also matches dots), e.g. 'model.*'")
    p.add_argument("--strip-prefix", metavar="PREFIX",
                   help="then remove PREFIX from the selected names that start with it, e.g. 'model.'")
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    p.set_defaults(_run=_run_convert)


# --------------------------------------------------------------------------- commands
def _run_inspect(args: argparse.Namespace) -> int:
    from .describe import format_table, inspect_checkpoint

    info = inspect_checkpoint(args.path)
    print(json.dumps(info.to_json(), indent=2) if args.json else format_table(info))
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    from .verify import verify_checkpoint
    from .wording import count

    report = verify_checkpoint(args.path, progress=not (args.quiet or args.json))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0 if report.ok else 1
    if not args.quiet:
        for line in report.checked:
            print(f"ok       {line}")
        for line in report.notes:
            print(f"note     {line}")
        for w in report.warnings:
            print(f"warning  {w}")
    for prob in report.problems:
        print(f"PROBLEM  {prob}")
    if not report.ok:
        print(f"{args.path}: NOT sound: {count(len(report.problems), 'problem')}")
    elif not args.quiet:  # --quiet: only problems, so nothing at all on a sound checkpoint
        extra = f"; {count(len(report.warnings), 'unreferenced file')}" if report.warnings else ""
        print(f"{args.path}: sound ({report.bytes_checked} bytes checked{extra})")
    return 0 if report.ok else 1


def _run_convert(args: argparse.Namespace) -> int:
    from ..conversion.driver import convert
    from ..io.progress import human_bytes

    t0 = time.monotonic()
    r = convert(args.src, args.dst, to=args.to, overwrite=args.overwrite, max_shard_size=args.max_shard_size,
                progress=not args.quiet, keys=args.keys, strip_prefix=args.strip_prefix)
    if not args.quiet:
        print(f"converted {args.src} ({r.source_format}) -> {r.path} ({r.target_format}): {r.tensors} tensors, "
              f"{human_bytes(r.tensor_bytes)} in {time.monotonic() - t0:.2f} s")
    return 0


# --------------------------------------------------------------------------- entry point
def _chosen_command(argv: Sequence[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


def _show_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    print(f"{PROG}: warning: {message}", file=sys.stderr)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, dict[str, str]]:
    parser, broken = build_parser(_chosen_command(argv))
    try:
        if broken:  # the chosen command could not load its arguments: accept whatever follows it
            return parser.parse_known_args(argv)[0], broken
        return parser.parse_args(argv), broken
    except SystemExit as e:  # --help, --version and usage errors: argparse has printed already
        raise _UsageExit(e.code if isinstance(e.code, int) else 2) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code.

    Example:
        >>> main(["inspect", "ckpt", "--json"])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, broken = _parse(argv)
    except _UsageExit as e:
        return e.code
    debug = bool(getattr(args, "debug", False))
    if args.command in broken:
        print(f"{PROG}: error: {broken[args.command]}", file=sys.stderr)
        return 1
    run: Callable[[argparse.Namespace], int] = args._run
    old_show = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        code = run(args)
        return int(code or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"{PROG}: error: {_describe(e)}", file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = old_show


def _describe(e: Exception) -> str:
    from ..errors import CheckpointError

    if isinstance(e, (CheckpointError, ValueError)):
        msg = str(e)
    elif isinstance(e, OSError) and e.strerror:
        msg = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    else:
        msg = f"{type(e).__name__}: {e}"
    expected = isinstance(e, (CheckpointError, OSError, ValueError))  # messages meant for users
    return " ".join(msg.split()) + " (use --debug for the traceback)" * (not expected)
