"""The CLI against hostile endpoints and inputs: a one-line error each, never a hang, a
MemoryError or a traceback (`kvpool.cli.inputs`)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.cli import stats
from kvpool.cli.inputs import InputError
from kvpool.cli.main import main

ANSWERS = {
    "deep": b"[" * 200_000 + b"]" * 200_000,
    "types": json.dumps({"hits": "many", "misses": 3}).encode(),
    "nan": b'{"hits": NaN}',
    "list": b"[1, 2]",
    "clients": json.dumps({"hits": 1, "client_list": [1, 2]}).encode(),
    "good": json.dumps({"hits": 3, "misses": 1, "memory_used": 10, "memory_capacity": 100,
                        "client_list": [{"client_id": 1, "pid": 2, "requests": 3}]}).encode(),
}


class _Hostile(http.server.BaseHTTPRequestHandler):
    """Answers GET /MODE/stats (or /MODE/metrics) as MODE says."""

    stop = threading.Event()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        mode = self.path.strip("/").split("/")[0]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        try:
            if mode == "trickle":  # a byte at a time, until the test ends
                while not self.stop.is_set():
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.05)
            elif mode == "endless":
                chunk = b" " * 65536
                while not self.stop.is_set():
                    self.wfile.write(chunk)
            else:
                self.wfile.write(ANSWERS[mode])
        except OSError:
            pass  # the client gave up: as it should


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _Hostile.stop.set()
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("mode", "says"), [
    ("trickle", "no complete answer within 0.5 s"),
    ("endless", "larger than"),
    ("deep", "nested too deeply"),
    ("types", "hits='many' is not a finite number"),
    ("nan", "hits=nan is not a finite number"),
    ("list", "a JSON list, not a kvpool server's stats object"),
    ("clients", "client_list is not a list of objects"),
])
def test_a_hostile_stats_endpoint_is_one_input_error(endpoint, mode, says):
    with pytest.raises(InputError) as exc:
        stats.fetch_from_url(f"{endpoint}/{mode}", timeout_s=0.5)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_a_hostile_metrics_endpoint_is_one_input_error(endpoint):
    with pytest.raises(InputError, match="no complete answer"):
        stats.fetch_prometheus(f"{endpoint}/trickle", timeout_s=0.5)
    with pytest.raises(InputError, match="larger than"):
        stats.fetch_prometheus(f"{endpoint}/endless", timeout_s=5)


def test_kvpool_stats_says_one_line_and_exits_1(endpoint, capsys):
    assert main(["stats", "--metrics-url", f"{endpoint}/deep"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nested too deeply" in err


def test_a_good_endpoint_still_reads(endpoint):
    got = stats.fetch_from_url(f"{endpoint}/good", timeout_s=5)
    assert got["hits"] == 3 and got["client_list"][0]["pid"] == 2


@pytest.mark.parametrize(("text", "says"), [
    ("@/dev/zero", "larger than"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("@/nonexistent/kvpool.json", "No such file"),
])
def test_kvpool_doctor_reads_a_hostile_config_as_one_error(text, says, capsys):
    assert main(["doctor", "--kv-transfer-config", text]) == 1
    out = capsys.readouterr().out
    assert "ERROR cannot read the kv-transfer-config" in out and says in out
