"""``libra``: the console entry point; one module per subcommand."""

from __future__ import annotations

import argparse
import logging
import sys

from libra.errors import LibraError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from libra.cli import commands, demo, max_batch

    parser = argparse.ArgumentParser(prog="libra", description="Train PyTorch models in less memory.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log Libra's INFO lines to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    commands.add_parsers(sub)
    demo.add_parser(sub)
    max_batch.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except LibraError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
