"""The `kvpool` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool", description="KV-cache pool for vLLM")
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("build-model", help="build a small random-weight model (no download)")
    m.add_argument("out_dir")
    m.add_argument("--spec", default="tiny")
    sub.add_parser("version", help="print kvpool's version")
    args = parser.parse_args(argv)
    if args.cmd == "version":
        from importlib.metadata import version

        print(version("kvpool"))
    elif args.cmd == "build-model":
        from kvpool.demo.model import main as build

        build([args.out_dir, "--spec", args.spec])
    return 0


if __name__ == "__main__":
    sys.exit(main())
