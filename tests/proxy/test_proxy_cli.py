"""The commands themselves, as a user runs them: `kvpool proxy` and `python -m kvpool.proxy`."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from kvpool.testing.launch import ProxyServer


def test_python_m_kvpool_proxy_rejects_mismatched_lists_with_a_clear_message():
    out = subprocess.run([sys.executable, "-m", "kvpool.proxy", "--prefiller-hosts", "h1", "h2",
                          "--prefiller-ports", "8100", "8101", "8102", "--decoder-hosts", "h",
                          "--decoder-ports", "8200"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == ("kvpool proxy: error: --prefiller-hosts/--prefiller-ports: give one host per "
                                  "port, or a single host for all the ports (got 2 hosts and 3 ports)")


def test_kvpool_proxy_serves_with_the_spec_arguments(make_peer, tmp_path):
    p, d = make_peer("P", cached_tokens=3), make_peer("D")
    proxy = ProxyServer([p.port], [d.port], host="localhost", backend_host="localhost",
                        entry=("-m", "kvpool.cli", "proxy"), extra_args=["--log-level", "warning"],
                        log_path=tmp_path / "proxy.log", startup_timeout_s=20)
    with proxy:
        with httpx.Client(base_url=f"http://127.0.0.1:{proxy.port}", trust_env=False, timeout=10) as client:
            resp = client.post("/v1/completions", json={
                "model": "m", "prompt": "Hello. I have a question. The president of the United States is",
                "max_completion_tokens": 20, "temperature": 0.0})
            assert resp.status_code == 200
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
        assert p.completions()[0].body["max_completion_tokens"] == 1
        assert d.completions()[0].body["max_completion_tokens"] == 20
    # uvicorn shuts down gracefully on SIGTERM and then re-raises it, so -SIGTERM is a clean exit.
    assert proxy.returncode in (0, -signal.SIGTERM), proxy.log()
    assert "Traceback" not in proxy.log(), proxy.log()


@pytest.mark.parametrize("flag", ["--port", "--max-retries", "--max-body-bytes"])
def test_integer_flags_take_ascii_digits_only(flag):
    import argparse

    from kvpool.proxy.config import add_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser.parse_args([flag, "８０００"])  # fullwidth digits: int() would take them
    assert getattr(parser.parse_args([flag, "8000"]), flag[2:].replace("-", "_")) == 8000


def test_kvpool_proxy_routes_pd_mixed_instances(make_peer, tmp_path):
    a, b = make_peer("A", cached_tokens=5), make_peer("B")
    proxy = ProxyServer([], [], instance_ports=[a.port, b.port], entry=("-m", "kvpool.cli", "proxy"),
                        extra_args=["--log-level", "warning", "--routing-policy", "round_robin"],
                        log_path=tmp_path / "proxy.log", startup_timeout_s=20)
    with proxy:
        with httpx.Client(base_url=f"http://127.0.0.1:{proxy.port}", trust_env=False, timeout=10) as client:
            for _ in range(2):
                resp = client.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 3})
                assert resp.status_code == 200, resp.text
            assert client.get("/healthcheck").json()["healthy_mixed_instances"] == 2
        assert [len(a.completions()), len(b.completions())] == [1, 1]
        assert a.completions()[0].body == {"model": "m", "prompt": "Hello", "max_tokens": 3}
    assert proxy.returncode in (0, -signal.SIGTERM), proxy.log()
    assert "Traceback" not in proxy.log(), proxy.log()


def test_a_proxy_counts_as_ready_once_every_instance_it_was_given_is_in_rotation():
    from kvpool.testing.launch import every_instance_in_rotation

    mixed = {"status": "ok", "mixed_instances": 2, "healthy_mixed_instances": 1, "requests_in_flight": 0}
    assert not every_instance_in_rotation(mixed)  # a 200 already: one of the two is up
    assert every_instance_in_rotation({**mixed, "healthy_mixed_instances": 2})
    pd = {"prefill_instances": 1, "healthy_prefill_instances": 1, "decode_instances": 2, "healthy_decode_instances": 2}
    assert every_instance_in_rotation(pd)
    assert not every_instance_in_rotation({**pd, "healthy_decode_instances": 1})
    assert not every_instance_in_rotation({"status": "unavailable"})
