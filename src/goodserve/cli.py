"""`goodserve` command line: each subcommand lives beside the code it drives and registers here."""

from __future__ import annotations

import argparse
import importlib
import sys

from goodserve.errors import GoodserveError

# module that defines register(subparsers) -> None; each parser sets `func(args) -> int`.
SUBCOMMAND_MODULES = [
    "goodserve.commands.generate",
    "goodserve.server.command",
    "goodserve.bench.command",
    "goodserve.diagnose.command",
    "goodserve.diagnose.calc_command",
    "goodserve.quant.eval_command",
    "goodserve.quant.quantize_command",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="goodserve",
        description="LLM inference server built for goodput, with its own measuring instruments.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except GoodserveError as exc:
        print(f"goodserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
