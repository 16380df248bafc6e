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
    "goodserve.router.command",
    "goodserve.bench.command",
    "goodserve.diagnose.command",
    "goodserve.diagnose.calc_command",
    "goodserve.commands.eval",
    "goodserve.commands.quantize",
    "goodserve.commands.batch",
    "goodserve.commands.worker",
    "goodserve.tune.command",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="goodserve",
        description="LLM inference server built for goodput, with its own measuring instruments.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    show_defaults(parser)
    return parser


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help ends with its default, in every subcommand (ArgumentDefaultsHelpFormatter
    would skip options without help text and repeat the defaults some help texts already state).
    Help that says "default" itself is left alone: it names where the default comes from. On/off
    switches (store_true / store_false) are off unless given, which their default would only blur."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                show_defaults(subparser)
        elif (action.option_strings and not action.required and action.default is not argparse.SUPPRESS
              and not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
              and action.help is not argparse.SUPPRESS and "default" not in (action.help or "")):
            action.help = f"{action.help} (default: %(default)s)" if action.help else "(default: %(default)s)"


def main(argv: list[str] | None = None) -> int:
    from goodserve.bench.command import with_default_action

    parser = build_parser()
    args = parser.parse_args(with_default_action(list(sys.argv[1:] if argv is None else argv)))
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
