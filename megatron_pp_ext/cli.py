"""Command line: ``megatron-pp-ext simulate|train|bench``.

Commands that need torch are imported only when chosen, so ``simulate`` runs without it.
Bad input prints one line naming the flag and exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import quiet
from .errors import JobError, UsageError

# command name -> module under megatron_pp_ext.commands with add_parser(subparsers)
COMMANDS = {"simulate": "simulate", "plan": "plan", "train": "train", "bench": "bench"}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-pp-ext",
        description="Pipeline-parallel schedules for Megatron-core: simulate, plan, train, bench.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, module_name in COMMANDS.items():
        if chosen is not None and name != chosen:
            subparsers.add_parser(name, help=f"see 'megatron-pp-ext {name} --help'")
            continue
        try:
            module = importlib.import_module(f".commands.{module_name}", __package__)
        except ModuleNotFoundError as error:
            if chosen == name:
                hint = f"megatron-pp-ext {name}: needs {error.name} (pip install -e .[runtime])"
                raise SystemExit(hint) from None
            subparsers.add_parser(name, help=f"(unavailable: {error.name} not installed)")
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # before any megatron-core import: here and in the processes this command starts
    if "--verbose" in argv:
        os.environ.pop(quiet.QUIET_VARIABLE, None)
    else:
        os.environ[quiet.QUIET_VARIABLE] = "1"
        quiet.install()
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        status = int(args.run(args) or 0)
        sys.stdout.flush()  # here, so that a reader gone away is answered below
        return status
    except BrokenPipeError:  # the reader (head, less) went away: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit
        return 1
    except UsageError as error:
        print(f"megatron-pp-ext {args.command}: error: {error}", file=sys.stderr)
        return 2
    except JobError as error:
        print(f"megatron-pp-ext {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
