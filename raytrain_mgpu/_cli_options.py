"""Command-line pieces of ``raytrain-mgpu``, shared with the benchmarks' ``add_arguments``: its parser (errors in
one line naming the command's closest option, no abbreviations), help as plain text with each default said
once, lists that take words apart or joined by commas, and old option names kept working (hidden, with a
one-line deprecation warning). No torch, no Ray: ``--help`` stays fast."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, Callable, List, Optional, Sequence

from raytrain_mgpu.config.names import did_you_mean

__all__ = ["HelpFormatter", "Parser", "UsageError", "WordList", "plain", "renamed", "split_commas"]


def plain(rest: str) -> str:
    """A docstring's reST markup as a terminal shows text: ``x`` and `x` -> x, :class:`~a.b.C` -> C,
    :func:`a.f` -> a.f, :doc:`title <target>` -> title."""
    def role(match: re.Match) -> str:
        text = match.group(1)
        titled = re.fullmatch(r"(.+?)\s*<[^<>]*>", text)
        return titled.group(1) if titled else text[1:].rsplit(".", 1)[-1] if text.startswith("~") else text

    text = re.sub(r":[\w.:+-]+:`([^`]+)`", role, rest)
    return re.sub(r"``(.+?)``|`([^`]+)`", lambda m: m.group(1) or m.group(2), text)


class HelpFormatter(argparse.HelpFormatter):
    """Each option's help as plain text, its default said once: added unless the text says it already (a
    ``(default`` of its own) or there is nothing to say (None, False, an empty list: the option is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain(action.help or "")
        default = action.default
        if (not action.option_strings or "(default" in text or default is None or default is False
                or default is argparse.SUPPRESS or default == []):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def split_commas(values: Sequence[str]) -> List[str]:
    """``["ddp", "fsdp"]`` and ``["ddp,fsdp"]`` alike -> ``["ddp", "fsdp"]``."""
    return [part.strip() for value in values for part in str(value).split(",") if part.strip()]


class WordList(argparse.Action):
    """A list option (``nargs="+"``): words apart (``--only scale tests``) or joined by commas inside a word
    (``--only scale,tests``), as older commands wrote them."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, split_commas(values))


class _Renamed(argparse.Action):
    def __init__(self, option_strings, dest, new: argparse.Action, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        name = self.new.option_strings[0]
        print(f"{parser.prog}: warning: {option_string} is deprecated, use {name}", file=sys.stderr)
        self.new(parser, namespace, values, name)


def renamed(parser: argparse.ArgumentParser, action: argparse.Action, *old: str) -> None:
    """Keep the ``old`` spellings of ``action`` (what ``add_argument`` returned) working, hidden from ``--help``:
    each use prints one deprecation line on stderr and does what the new name does."""
    parser.add_argument(*old, action=_Renamed, new=action, dest=action.dest, nargs=action.nargs, type=action.type,
                        const=action.const, choices=action.choices, metavar=action.metavar,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


class UsageError(Exception):
    """A command line argparse cannot parse: reported in one line by ``main``."""


class Parser(argparse.ArgumentParser):
    """argparse prints the whole usage and exits; the CLI promises one line and status 2. An unknown option is
    reported by the command it was given to, with that command's closest option and its ``--help``; an unknown
    command or choice with the closest valid one.

    ``add_arguments``: a function that adds the options, called when this (sub)command is
    parsed; for the benchmarks, whose modules import torch, so the top-level ``--help``
    does not.
    """

    def __init__(self, *args, add_arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None,
                 **kwargs):
        # No abbreviations (`--gpus 2` must not set --gpus-per-worker); subcommands get these through add_parser.
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._add_arguments = add_arguments
        self._commands: Optional[argparse.Action] = None

    def add_subparsers(self, **kwargs):
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_known_args(self, args=None, namespace=None):
        if self._add_arguments is not None:
            add, self._add_arguments = self._add_arguments, None
            add(self)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # argparse would point to the top-level help, which lists no command's options
            parser = self
            while parser._commands is not None and getattr(parsed, parser._commands.dest, None):
                parser = parser._commands.choices[getattr(parsed, parser._commands.dest)]
            parser.error(f"unrecognized arguments: {' '.join(extras)}.{parser._closest_option(extras)}")
        return parsed

    def _closest_option(self, words: List[str]) -> str:
        """The closest of this command's options to the first unknown one, as ``did_you_mean`` says it (empty if
        none is close): an option it abbreviates, else the nearest spelling."""
        word = next((w.split("=")[0] for w in words if w.startswith("-")), None)
        options = [s for a in self._actions if a.help is not argparse.SUPPRESS for s in a.option_strings]
        longer = [o for o in options if word and o.startswith(word)]  # what an abbreviation used to pick
        return f" Did you mean {longer[0]!r}?" if len(longer) == 1 else did_you_mean(word, options)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is None or value in action.choices:
            return
        names = [str(choice) for choice in action.choices]
        if action is self._commands:
            message = f"unknown command {value!r}.{did_you_mean(value, names)} Commands: {', '.join(names)}"
            raise argparse.ArgumentError(None, message)
        raise argparse.ArgumentError(action, f"invalid choice: {value!r}.{did_you_mean(value, names)} "
                                             f"Valid: {', '.join(names)}")

    def error(self, message: str):
        message = message.replace("\r", "\\r").replace("\n", "\\n")  # one line, whatever was typed
        raise UsageError(f"{message} (see `{self.prog} --help`)")
