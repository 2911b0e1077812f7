"""The ``mmapckpt`` command line: ``main(argv) -> int``.

Subcommands: demo, inspect, verify, convert, bench. ``demo`` and ``bench`` live in
their own modules (bench/demo.py, bench/command.py: ``add_arguments(parser)`` and ``run(args)``),
imported only when that subcommand is chosen, so a broken one affects only itself.
Errors print one line, ``mmapckpt: error: ...``, on stderr and return non-zero;
``--debug`` shows the traceback instead. Nothing here imports torch until a command runs
(``--help`` and ``--version`` never do).

Exit codes: 0 success; 1 an error, or ``verify`` found problems; 2 bad usage; 130 interrupted
(Ctrl-C: one line, no traceback, the conversion's temporary files removed); 141 the reader of
stdout went away (``mmapckpt inspect CKPT | head``: nothing more is printed, as a Unix tool
killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any, Callable, Sequence

from ..reading.families import FORMATS

__all__ = ["main", "build_parser", "COMMANDS"]

PROG = "mmapckpt"
#: subcommand -> one-line help; the lazily imported ones map to their module.
COMMANDS = {
    "demo": "save and load a small model with mmapckpt, side by side with stock DCP",
    "inspect": "show a checkpoint's format, version and entries (any supported format)",
    "verify": "check a checkpoint: mmapckpt completely (metadata, headers, bounds, checksums), others as they allow",
    "convert": "convert between mmapckpt, stock DCP, safetensors and torch.save",
    "bench": "benchmark mmapckpt against stock DCP and safetensors",
}
# Imported by name when chosen: tools/ is the top wing, so these are imports downward (bench/).
_LAZY = {"demo": "mmapckpt.bench.demo", "bench": "mmapckpt.bench.command"}


#: 128 + SIGINT and 128 + SIGPIPE, what a shell reports for a tool those signals ended.
EXIT_INTERRUPTED, EXIT_PIPE_CLOSED = 130, 141


class _UsageExit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class _StdoutClosed(Exception):
    """The reader of stdout went away (EPIPE)."""


def _emit(text: str) -> None:
    """Print ``text`` on stdout; a closed pipe becomes _StdoutClosed (main exits quietly)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise _StdoutClosed() from None


def _version() -> str:
    from .._version import __version__
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
    p.add_argument("--keys", metavar="PATTERN", action="append",
                   help="show only entries whose stored name matches this glob (repeatable; as convert --keys)")
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
    p.add_argument("--to", choices=FORMATS, help="target format (default: from DST's extension: .safetensors; "
                   ".pt, .pth, .bin for torch; anything else, a directory, is mmapckpt)")
    p.add_argument("--max-shard-size", metavar="SIZE", type=_size,
                   help="safetensors only: write Hugging Face-style shards of at most SIZE (e.g. 5GB, 500MiB) "
                   "with model.safetensors.index.json")
    p.add_argument("--keys", metavar="PATTERN", action="append",
                   help="convert only entries whose stored name matches this glob (repeatable; case-sensitive, "
                   "'*' also matches dots), e.g. 'model.*'")
    p.add_argument("--exclude", metavar="PATTERN", action="append",
                   help="then leave out entries whose stored name matches this glob (repeatable), e.g. 'optim.*'")
    p.add_argument("--dtype", metavar="DTYPE", type=_dtype_name,
                   help="cast float16/bfloat16/float32/float64 tensors to DTYPE (bfloat16, float16, float32, "
                   "float64; or bf16, fp16, fp32, fp64); other dtypes are kept; a finite value outside DTYPE's "
                   "range is refused")
    p.add_argument("--allow-cast", action="store_true",
                   help="with --dtype, cast even values outside DTYPE's range (they become inf)")
    p.add_argument("--strip-prefix", metavar="PREFIX",
                   help="then remove PREFIX from the selected names that start with it, e.g. 'model.'")
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    p.set_defaults(_run=_run_convert)


_DTYPES = ("bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float", "float64", "fp64", "double")


def _size(text: str) -> str:
    """``--max-shard-size``: checked while parsing (a bad size is a usage error, exit 2), passed on as given."""
    from ..io.sizes import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _dtype_name(text: str) -> str:
    if text.lower().removeprefix("torch.") not in _DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; use one of {', '.join(_DTYPES)}")
    return text.lower().removeprefix("torch.")


# --------------------------------------------------------------------------- commands
def _run_inspect(args: argparse.Namespace) -> int:
    from ..manage.describe import inspect_root  # a managed root (ROOT/.mmapckpt-root): its steps, docs/manager.md
    from .describe import format_table, inspect_checkpoint

    text = inspect_root(args.path, as_json=args.json)
    if text is not None:
        _emit(text)
        return 0
    info = inspect_checkpoint(args.path, keys=args.keys)
    _emit(json.dumps(info.to_json(), indent=2) if args.json else format_table(info))
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    from .verify import verify_checkpoint
    from .wording import count

    report = verify_checkpoint(args.path, progress=not (args.quiet or args.json))
    if args.json:
        _emit(json.dumps(report.to_json(), indent=2))
        return 0 if report.ok else 1
    if not args.quiet:
        for line in report.checked:
            _emit(f"ok       {line}")
        for line in report.notes:
            _emit(f"note     {line}")
        for w in report.warnings:
            _emit(f"warning  {w}")
    for prob in report.problems:
        _emit(f"PROBLEM  {prob}")
    if not report.ok:
        _emit(f"{args.path}: NOT sound: {count(len(report.problems), 'problem')}")
    elif not args.quiet:  # --quiet: only problems, so nothing at all on a sound checkpoint
        extra = f"; {count(len(report.warnings), 'unreferenced file')}" if report.warnings else ""
        _emit(f"{args.path}: sound ({report.bytes_checked} bytes checked{extra})")
    return 0 if report.ok else 1


def _run_convert(args: argparse.Namespace) -> int:
    from ..conversion.driver import convert, sharded_formats, target_format
    from ..conversion.progress import human_bytes
    _Interrupt.check()  # a Ctrl-C during those imports that a library swallowed: stop before any work

    to = args.to or target_format(args.dst)
    sharded = sharded_formats()
    if args.max_shard_size is not None and to not in sharded:
        print(f"{PROG} convert: error: --max-shard-size applies only to {' and '.join(sharded)} output, not {to}",
              file=sys.stderr)
        return 2
    t0 = time.monotonic()
    r = convert(args.src, args.dst, to=to, overwrite=args.overwrite, max_shard_size=args.max_shard_size,
                progress=not args.quiet, keys=args.keys, exclude=args.exclude, strip_prefix=args.strip_prefix,
                dtype=args.dtype, allow_cast=args.allow_cast)
    if not args.quiet:
        _emit(f"converted {args.src} ({r.source_format}) -> {r.path} ({r.target_format}): {r.tensors} tensors, "
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
    except KeyboardInterrupt:  # Ctrl-C before a command runs: still one line
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    debug = bool(getattr(args, "debug", False))
    if args.command in broken:
        print(f"{PROG}: error: {broken[args.command]}", file=sys.stderr)
        return 1
    run: Callable[[argparse.Namespace], int] = args._run
    old_show = warnings.showwarning
    warnings.showwarning = _show_warning
    interrupt = _Interrupt()
    try:
        with interrupt:
            code = int(run(args) or 0)
            _Interrupt.check()  # a Ctrl-C that a library swallowed whole: still reported as one
            return code
    except _StdoutClosed:
        _silence_stdout()
        return EXIT_PIPE_CLOSED
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if debug:
            raise
        if interrupt.hit:  # Ctrl-C that a library turned into its own error (torch.save's RuntimeError)
            print(f"{PROG}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"{PROG}: error: {_describe(e)}", file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = old_show


class _Interrupt:
    """While a command runs: the first Ctrl-C raises KeyboardInterrupt (and is remembered, for when a library
    turns it into an error of its own); later ones are ignored, so the cleanup it starts (temporary files
    removed) is not cut short. Outside the main thread, or where SIGINT is not Python's default, nothing
    changes."""

    #: the one installed in this process (main thread), for check()
    current: "_Interrupt | None" = None

    def __init__(self) -> None:
        self.hit = False
        self._old: Any = None

    @classmethod
    def check(cls) -> None:
        """Raise KeyboardInterrupt if Ctrl-C came and was swallowed (a bare ``except:`` in an imported library
        catches the KeyboardInterrupt the handler raised; the hit stays recorded)."""
        if cls.current is not None and cls.current.hit:
            raise KeyboardInterrupt

    def _handler(self, signum: int, frame: Any) -> None:
        self.hit = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    def __enter__(self) -> "_Interrupt":
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._old = signal.signal(signal.SIGINT, self._handler)
            _Interrupt.current = self
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            _Interrupt.current = None


def _silence_stdout() -> None:
    """After EPIPE on stdout: point it at /dev/null, so the interpreter's last flush does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (a test's capture)
        pass


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
