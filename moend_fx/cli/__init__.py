"""The ``moend`` command line: one entry point, one module per subcommand group.

Each module in ``SUBCOMMAND_MODULES`` defines ``register(subparsers) -> None``, which adds its subcommands
with ``set_defaults(func=handler)``; a handler takes the parsed ``argparse.Namespace`` and returns an exit
code. User mistakes raise :class:`moend_fx.common.errors.MoendError`: printed as one line, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, NoReturn

from moend_fx.common.errors import MoendError

# Order = order in `moend --help`. A module that fails to import is a bug, not a user error: let it raise.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "moend_fx.cli.calibrate",
    "moend_fx.cli.solve",
    "moend_fx.cli.search",
    "moend_fx.cli.evaluate",
    "moend_fx.cli.report",
    "moend_fx.cli.generate",
    "moend_fx.cli.bench",
)


class MoendParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with one-line errors, that remembers its subcommands and the options added
    to it directly (argparse keeps both in private attributes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set first: argparse's own __init__ already adds --help through add_argument.
        self.declared: list[argparse.Action] = []
        self._subcommand_group: Any = None
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # argparse's own exit code 2, one line, no usage dump
        self.exit(2, f"moend: error: {message} (see '{self.prog} --help')\n")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.declared.append(action)
        return action

    def add_subparsers(self, **kwargs: Any) -> Any:
        kwargs.setdefault("parser_class", MoendParser)
        self._subcommand_group = super().add_subparsers(**kwargs)
        return self._subcommand_group

    def subcommands(self) -> dict[str, argparse.ArgumentParser]:
        """``{name: parser}`` of the subcommands added to this parser, in order (empty if none): the
        ``choices`` of the action ``add_subparsers`` returned."""
        return dict(self._subcommand_group.choices) if self._subcommand_group is not None else {}


def build_parser() -> MoendParser:
    parser = MoendParser(
        prog="moend",
        description="MoE-nD per-layer KV-cache compression: calibrate, solve, evaluate, compile, benchmark.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _torch_threads() -> int | None:
    """torch's intra-op thread count, or None while torch is not imported (then there is nothing to restore)."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.get_num_threads()


def main(argv: list[str] | None = None) -> int:
    """Run one ``moend`` command. ``--threads`` (and the benchmarks' default of every core) sets torch's
    intra-op threads for the command only: a caller in the same process (a test, a notebook) gets its own count
    back. Left set, one in-process ``moend bench`` call put a pytest worker at 2 threads beside another on 2
    cores, and the whole suite took 23-26 minutes instead of 13."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    threads = _torch_threads()
    try:
        return int(args.func(args) or 0)
    except MoendError as e:
        print(f"moend: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"moend: error: file not found: {e.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moend: interrupted", file=sys.stderr)
        return 130
    finally:
        if threads is not None:
            sys.modules["torch"].set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
