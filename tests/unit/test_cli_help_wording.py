"""Help a user can act on: every engine flag says what it does (not its field name again), diagnose's
examples stay one a line, and no help text speaks of issues or machines of the project's own."""

from __future__ import annotations

import argparse
import re

from goodserve.cli import build_parser


def all_helps(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from all_helps(sub, (*path, name))
        elif action.option_strings and action.help not in (None, argparse.SUPPRESS):
            yield path, action.option_strings[0], action.help


def test_no_flag_help_only_repeats_its_name():
    placeholders = []
    for path, flag, help_text in all_helps(build_parser()):
        words = re.sub(r"\s*\(default: [^)]*\)$", "", help_text).strip()
        if words == flag.lstrip("-").replace("-", " "):
            placeholders.append(f"{' '.join(path)} {flag}: {help_text}")
    assert placeholders == []


def test_no_help_mentions_issues_or_lent_machines():
    texts = [help_text for _, _, help_text in all_helps(build_parser())]
    parser = build_parser()
    texts += [sub.format_help() for action in parser._actions if isinstance(action, argparse._SubParsersAction)
              for sub in action.choices.values()]
    assert not [t for t in texts if re.search(r"\bissue \d+|\blent\b", t)]


def test_diagnose_help_keeps_its_examples_one_a_line():
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    text = commands.choices["diagnose"].format_help()
    examples = [line.strip() for line in text.splitlines() if line.strip().startswith("goodserve diagnose")]
    assert len(examples) == 5 and all(line.count("goodserve diagnose") == 1 for line in examples)
