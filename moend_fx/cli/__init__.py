"""The ``moend`` command line: one entry point, one module per subcommand group.

Each module in ``SUBCOMMAND_MODULES`` defines ``register(subparsers) -> None``, which adds its subcommands
with ``set_defaults(func=handler)``; a handler takes the parsed ``argparse.Namespace`` and returns an exit
code. User mistakes raise :class:`moend_fx.common.errors.MoendError`: printed as one line, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moend_fx.common.errors import MoendError

# Order = order in `moend --help`. A module that fails to import is a bug, not a user error: let it raise.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "moend_fx.cli.calibrate",
    "moend_fx.cli.solve",
    "moend_fx.cli.evaluate",
    "moend_fx.cli.generate",
    "moend_fx.cli.bench",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code 2, one line, no usage dump
        self.exit(2, f"moend: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moend",
        description="MoE-nD per-layer KV-cache compression: calibrate, solve, evaluate, compile, benchmark.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # subcommand not written yet
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
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


if __name__ == "__main__":
    sys.exit(main())
