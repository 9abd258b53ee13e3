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
    # Imported here rather than on use so `--help` lists their flags; both are light (no vLLM).
    from kvpool.cli import stats as statsview
    from kvpool.server import daemon as server

    server.add_arguments(sub.add_parser("server", help="run the host-shared pool daemon (backend: server)"))
    statsview.add_arguments(sub.add_parser("stats", help="show a running server's usage, hit rate and clients"))
    from kvpool.proxy import config as proxy_config  # stdlib only; the web stack loads on use

    proxy_config.add_arguments(sub.add_parser("proxy", help="run the proxy: PD disaggregation (prefill, then decode) or routing of PD-mixed instances"))
    from kvpool.cli import doctor  # stdlib + kvpool config only

    doctor.add_arguments(sub.add_parser("doctor", help="check a deployment's config, files and services before vLLM starts"))
    from kvpool.plan import command as plan  # numpy + msgspec; matplotlib loads only to plot

    plan.add_arguments(sub.add_parser("plan", help="capacity planner: replay a trace, hit rate against pool size"))
    args = parser.parse_args(argv)
    if args.cmd == "plan":
        return plan.run(args)
    if args.cmd == "doctor":
        return doctor.run(args)
    if args.cmd == "server":
        return server.run(args)
    if args.cmd == "stats":
        return statsview.run(args)
    if args.cmd == "proxy":
        from kvpool.proxy.app import run as run_proxy

        return run_proxy(args)
    if args.cmd == "version":
        from importlib.metadata import version

        print(version("kvpool"))
    elif args.cmd == "build-model":
        from kvpool.testing.model import main as build

        build([args.out_dir, "--spec", args.spec])
    return 0


if __name__ == "__main__":
    sys.exit(main())
