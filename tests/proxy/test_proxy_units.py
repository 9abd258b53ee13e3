"""The proxy's pure parts: argument validation, least-loaded selection, payloads, usage rewriting."""

from __future__ import annotations

import argparse
import json

import pytest

from kvpool import cli
from kvpool.errors import ConfigError
from kvpool.proxy.config import Endpoint, add_arguments, config_from_args
from kvpool.proxy.forward import (
    SSEUsageRewriter,
    decode_payload,
    merge_usage,
    prefill_payload,
)
from kvpool.proxy.registry import Registry, Role


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_spec_arguments_and_safe_defaults():
    cfg = parse("--host", "localhost", "--prefiller-hosts", "localhost", "--prefiller-ports", "8100",
                "--decoder-hosts", "localhost", "--decoder-ports", "8200")
    assert cfg.host == "localhost" and cfg.port == 8000
    assert cfg.prefillers == (Endpoint("localhost", 8100),)
    assert cfg.decoders == (Endpoint("localhost", 8200),)
    default = parse("--instance-hosts", "localhost", "--instance-ports", "8100")
    assert default.host == "127.0.0.1"  # never every interface unless asked
    assert default.max_retries == 3 and default.retry_delay > 0 and default.timeout > 0


def test_host_lists_pair_with_port_lists_or_one_host_serves_all():
    cfg = parse("--prefiller-hosts", "10.0.0.1", "10.0.0.2", "--prefiller-ports", "8100", "8101",
                "--decoder-hosts", "10.0.0.3", "--decoder-ports", "8200", "8201", "8202")
    assert [e.key for e in cfg.prefillers] == ["10.0.0.1:8100", "10.0.0.2:8101"]
    assert [e.key for e in cfg.decoders] == ["10.0.0.3:8200", "10.0.0.3:8201", "10.0.0.3:8202"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--prefiller-hosts", "a", "b", "c", "--prefiller-ports", "1", "2"], "3 hosts and 2 ports"),
    (["--decoder-hosts", "a", "b", "--decoder-ports", "1", "2", "3"], "2 hosts and 3 ports"),
    (["--prefiller-ports", "8100"], "--prefiller-ports needs hosts"),
    (["--decoder-hosts", "x"], "--decoder-hosts needs ports"),
    (["--decoder-hosts", "x", "--decoder-ports", "80000"], "TCP port number"),
    (["--prefiller-hosts", "x", "--prefiller-ports", "eighty"], "TCP port number"),
    (["--prefiller-hosts", "x", "--prefiller-ports", "1", "1"], "listed twice"),
    (["--max-retries", "-1"], "0 or more"),
    (["--timeout", "0"], "seconds > 0"),
])
def test_bad_arguments_exit_with_a_clear_message(argv, message, capsys):
    assert cli.main(["proxy", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool proxy: error: ") and message in err
    with pytest.raises(ConfigError):
        parse(*argv)


# ---------------------------------------------------------------- least-loaded selection

def _registry(n: int = 3) -> tuple[Registry, list]:
    reg = Registry([Endpoint("h", 8100 + i) for i in range(n)], [])
    return reg, reg.instances(Role.PREFILL)


def test_pick_prefers_fewest_in_flight_then_fewest_tokens_then_round_robin():
    reg, (a, b, c) = _registry()
    assert [reg.pick(Role.PREFILL).key for _ in range(4)] == [a.key, b.key, c.key, a.key]  # round-robin on ties
    la = reg.lease(a, 10)
    reg.lease(b, 500)
    assert reg.pick(Role.PREFILL) is c  # only c has nothing in flight
    reg.lease(c, 100)
    assert reg.pick(Role.PREFILL) is a  # all have 1 in flight: fewest tokens wins
    la.release()
    la.release()  # idempotent
    assert a.in_flight == 0 and a.token_load == 0
    assert reg.pick(Role.PREFILL) is a


def test_pick_skips_down_and_tried_instances_and_a_retry_never_goes_back():
    reg, (a, b, c) = _registry()
    reg.mark_down(a, "refused")
    assert {reg.pick(Role.PREFILL).key for _ in range(4)} == {b.key, c.key}
    assert reg.pick(Role.PREFILL, exclude=[b]) is c
    assert reg.pick(Role.PREFILL, exclude=[b, c]) is None  # a retry: only healthy, untried ones
    reg.mark_down(b, "refused")
    reg.mark_down(c, "refused")
    assert reg.pick(Role.PREFILL) is not None  # a first attempt's last resort: try a down one
    assert reg.pick(Role.PREFILL, exclude=[c]) is None
    reg.mark_up(b)
    assert reg.pick(Role.PREFILL) is b
    assert reg.pick(Role.DECODE) is None


# ---------------------------------------------------------------- payloads and usage

def test_prefill_payload_asks_for_one_token_without_streaming_and_keeps_the_rest():
    body = {"model": "m", "prompt": "hi", "max_tokens": 200, "max_completion_tokens": 200, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "n": 2, "temperature": 0.0}
    p = prefill_payload(body)
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["stream"] is False and p["n"] == 1
    assert "stream_options" not in p and "min_tokens" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["temperature"] == 0.0 and p["prompt"] == "hi"
    assert body["max_tokens"] == 200 and body["stream"] is True  # the original is untouched
    assert "max_completion_tokens" not in prefill_payload({"prompt": "x", "max_tokens": 9})
    assert decode_payload(body, {"remote_block_ids": [1]})["kv_transfer_params"] == {"remote_block_ids": [1]}
    assert decode_payload(body, None) == body


def test_usage_reports_the_prefills_cached_tokens_and_keeps_the_decoders():
    data = {"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 96}}}
    assert merge_usage(data, 64)
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 64, "decode_cached_tokens": 96}
    data = {"usage": {"prompt_tokens": 100, "prompt_tokens_details": None}}
    assert merge_usage(data, 0) and data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert not merge_usage({"usage": None}, 5)


def test_sse_rewriter_rewrites_usage_events_and_passes_the_rest_byte_for_byte():
    events = [b'data: {"choices":[{"text":"a"}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":7,"prompt_tokens_details":null}}\n\n',
              b"data: [DONE]\n\n"]
    stream = b"".join(events)
    rw = SSEUsageRewriter(5)
    out = b"".join(rw.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + rw.flush()
    parts = out.split(b"\n\n")
    assert parts[0] + b"\n\n" == events[0] and parts[2] + b"\n\n" == events[2]
    usage = json.loads(parts[1][len(b"data: "):])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 5} and usage["prompt_tokens"] == 7
    rw = SSEUsageRewriter(5)
    assert rw.feed(b'data: {"choices":[]}') == b""  # an event is held only until its end arrives
    assert rw.feed(b"\n\n") == b'data: {"choices":[]}\n\n'


def test_health_probe_access_lines_only_at_debug():
    import logging

    from kvpool.proxy.app import ProbesAtDebug

    def line(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5000", "GET", path, "1.1", 200), None)

    f, proxy_log = ProbesAtDebug(), logging.getLogger("kvpool.proxy")
    old = proxy_log.level
    try:
        proxy_log.setLevel(logging.INFO)
        assert not f.filter(line("/health")) and not f.filter(line("/healthcheck?x=1"))
        assert f.filter(line("/v1/completions"))
        proxy_log.setLevel(logging.DEBUG)
        assert f.filter(line("/health"))
    finally:
        proxy_log.setLevel(old)
