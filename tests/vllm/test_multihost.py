"""docs/deploy.md's many-host walk-through, run as written, on three "hosts".

The hosts are Linux network namespaces with addresses of their own on a private /24, joined by
a bridge (`kvpool.testing.netns`); the test itself, outside them, is the client. Every command
comes from the page's marked steps (`kvpool.testing.docsteps`), run with bash on the hosts the
step names: `mooncake_master` on A; mooncake.json, `kvpool doctor` and a vLLM OpenAI server on
B and C (backend `mooncake`, `local_hostname` each host's own address); `kvpool proxy` on A, in
front of both. Then, through the proxy:

1. a prompt goes to one host (the writer), which computes it: no cached tokens, token ids equal
   to vLLM's own cold run (the session's reference engine);
2. the master (the page's own admin queries, on A) names both segments by their hosts'
   addresses and holds every key the writer stored in the writer's segment;
3. the same prompt goes to the other host (the reader), which never saw it: cached tokens =
   the prompt's whole blocks, token ids equal to vLLM's own prefix-cache hit, and the reader's
   segment still holds nothing, so what it loaded came from the writer's, across hosts;
4. the prompt goes to the writer again, a hit in its own prefix cache: the reader's pool hit
   and this answer took the same tokens from a cache and computed the same ones with the same
   serving flags, so their top-5 logprobs must be equal bit for bit (README.md, exactness rule);
5. the reader's vLLM prefix cache cleared, the prompt is a hit from the reader's own host pool:
   Mooncake is not asked again (the reader's remote-tier hits do not move);
6. the writer's host pool stopped and the reader's restarted empty, the prompt is still a hit on
   the reader, from Mooncake (the writer's vLLM still holds its segment).

Only token ids are compared with the reference engine: the OpenAI servers do not run its
serving loop. Mooncake is run as configured on the page, which is the point: a wrong
`local_hostname` (or a service bound to loopback) works on 127.0.0.1 and fails here.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from harness import BLOCK, tokens, whole
from kvpool.testing.docsteps import assigned_variables, doc_steps, used_variables
from kvpool.testing.launch import DEFAULT_ENV, IN_PROCESS_WORKER_ENV, ChildProcess, every_instance_in_rotation
from kvpool.testing.launch import parse_metric
from kvpool.testing.netns import VirtualHost, VirtualNetwork, unavailable_reason

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deploy.md"
STEPS = doc_steps(DOC)
# What the page's steps are, and on which hosts each runs: a step added, dropped or moved
# fails here first, so the test never silently skips part of the walk-through.
EXPECTED = {"hosts": (), "master": ("A",), "config": ("B", "C"), "server": ("B", "C"), "instance": ("B", "C"),
            "proxy": ("A",), "segments": ("A",), "keys": ("A",), "where": ("A",)}
PORT = {"master": 50088, "server": 0, "instance": 8000, "proxy": 8000}
MAX_TOKENS = 8
PROMPT = tokens(300, seed=9301)  # 2 whole blocks, then 44 tokens every run computes
SEGMENT_SIZE = "256MB"  # the page says 20GB: two of those do not fit this machine
HOST_POOL_SIZE = "128MB"  # the page says 16GB


class StepProcess(ChildProcess):
    """One long-running step (bash running the page's block) on one host, ready once
    `host:port` accepts TCP connections from outside the host."""

    poll_interval_s = 0.2

    def __init__(self, step: str, host: VirtualHost, env: dict[str, str], port: int, log_dir: Path,
                 startup_timeout_s: float) -> None:
        self.name = f"step {step} on {host.name}"
        self.address = (host.address, port)
        super().__init__([*host.prefix, "bash", "-euo", "pipefail", "-c", STEPS[step].script], env=env,
                         log_path=log_dir / f"{step}-{host.name}.log", startup_timeout_s=startup_timeout_s)

    def _ready(self) -> bool:
        try:
            with socket.create_connection(self.address, timeout=0.5):
                return True
        except OSError:
            return False


class PoolStep(StepProcess):
    """The page's host pool step: ready once its server answers on its socket (the host's
    default one, in the runtime directory the test gives the host)."""

    def __init__(self, step: str, host: VirtualHost, env: dict[str, str], port: int, log_dir: Path,
                 startup_timeout_s: float) -> None:
        super().__init__(step, host, env, port, log_dir, startup_timeout_s)
        self.socket_path = os.path.join(env["XDG_RUNTIME_DIR"], "kvpool", "server.sock")

    def _ready(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(0.5)
                s.connect(self.socket_path)
                return True
        except OSError:
            return False


def run_step(step: str, host: VirtualHost, env: dict[str, str], timeout: float = 60) -> str:
    """A short step on `host`: its standard output (AssertionError with its output on failure)."""
    res = subprocess.run([*host.prefix, "bash", "-euo", "pipefail", "-c", STEPS[step].script], env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"step {step} on {host.name} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res.stdout


class Deployment:
    def __init__(self, net: VirtualNetwork, tmp: Path, model_dir: str) -> None:
        self.net = net
        self.hosts = net.hosts
        self.model = model_dir
        self.tmp = tmp
        # The page's variables (step "hosts") for this network, then per host: its own address,
        # and a private runtime directory, temp directory and KVPOOL_CONF (the namespaces share
        # this machine's file system, which real hosts do not).
        self.common = {"HOST_A": self.hosts["A"].address, "HOST_B": self.hosts["B"].address,
                       "HOST_C": self.hosts["C"].address, "MODEL": model_dir, "DTYPE": "float32",
                       "SEGMENT_SIZE": SEGMENT_SIZE, "HOST_POOL_SIZE": HOST_POOL_SIZE}
        self.running: list[ChildProcess] = []
        self.instances: dict[str, StepProcess] = {}  # by host address
        self.pools: dict[str, StepProcess] = {}  # the host pools, by host address
        self.writer = self.reader = ""  # the addresses the first test found

    def env(self, name: str, **extra: str) -> dict[str, str]:
        home = self.tmp / name
        for sub in ("run", "tmp", "conf"):
            (home / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        bin_dir = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        return {**env, **DEFAULT_ENV, **self.common, "HOST_IP": self.hosts[name].address,
                "KVPOOL_CONF": str(home / "conf"), "XDG_RUNTIME_DIR": str(home / "run"), "TMPDIR": str(home / "tmp"),
                "PATH": f"{bin_dir}:{os.environ['PATH']}", **extra}

    def start(self, step: str, host: str, timeout: float, **extra: str) -> StepProcess:
        kind = PoolStep if step == "server" else StepProcess
        p = kind(step, self.hosts[host], self.env(host, **extra), PORT[step], self.tmp, timeout)
        p.start(wait=False)
        self.running.append(p)
        return p

    def run(self, step: str, host: str, **extra: str) -> str:
        return run_step(step, self.hosts[host], self.env(host, **extra))

    def stop(self) -> None:
        for p in reversed(self.running):
            p.stop(grace_s=20)

    def wait_proxy_healthy(self, timeout_s: float = 30) -> None:
        """Until the proxy's health probe has seen both instances up (a 200 from GET /health
        alone says one is): the test's round robin needs both from its first request."""
        url = f"http://{self.hosts['A'].address}:{PORT['proxy']}/health"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = httpx.get(url, timeout=2, trust_env=False)
                if r.status_code == 200 and every_instance_in_rotation(r.json()):
                    return
            except httpx.HTTPError as exc:
                r = exc
            if time.monotonic() > deadline:
                raise AssertionError(f"{url}: {r}")
            time.sleep(0.2)

    def master_json(self, step: str, **extra: str) -> dict:
        return json.loads(self.run(step, "A", **extra))


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory):
    why = unavailable_reason()
    if why:
        pytest.skip(why)  # a failure under CI=true (tests/conftest.py)
    tmp = tmp_path_factory.mktemp("multihost")
    with VirtualNetwork(["A", "B", "C"]) as net:
        d = Deployment(net, tmp, model_dir)
        try:
            d.start("master", "A", timeout=30).wait_ready()
            for h in STEPS["config"].hosts:
                d.run("config", h)
            for h in STEPS["server"].hosts:
                p = d.start("server", h, timeout=30)
                p.wait_ready()
                d.pools[d.hosts[h].address] = p
            # What this test is about is addresses, not vLLM's process layout: the model runs in
            # the engine core's process, which starts sooner (IN_PROCESS_WORKER_ENV).
            # VLLM_SERVER_DEV_MODE: vLLM's /reset_prefix_cache, so that the test can send a prompt
            # to the pool again on an instance that has it in its own prefix cache.
            instances = [d.start("instance", h, timeout=600, VLLM_SERVER_DEV_MODE="1", **IN_PROCESS_WORKER_ENV)
                         for h in STEPS["instance"].hosts]
            d.instances = {p.address[0]: p for p in instances}
            proxy = d.start("proxy", "A", timeout=60)
            for p in (*instances, proxy):  # the start-ups overlap
                p.wait_ready()
            d.wait_proxy_healthy()
            yield d
        finally:
            d.stop()


def test_the_page_defines_what_its_steps_use():
    assert {name: s.hosts for name, s in STEPS.items()} == EXPECTED
    defined = assigned_variables(STEPS["hosts"].script)
    assert defined == {"HOST_A", "HOST_B", "HOST_C", "HOST_IP", "MODEL", "DTYPE", "KVPOOL_CONF", "SEGMENT_SIZE",
                       "HOST_POOL_SIZE"}
    for name, step in STEPS.items():
        # KEY: the key the "where" step asks about, one of the "keys" step's lines.
        missing = used_variables(step.script) - defined - assigned_variables(step.script) - {"KEY"}
        assert not missing, f"step {name} (docs/deploy.md:{step.line}) uses {missing}, which no step defines"


def test_a_config_without_local_hostname_advertises_the_hosts_own_address(deployment):
    # What deploy/k8s/vllm-mooncake.yaml relies on: a mooncake.json without local_hostname
    # advertises the address that routes to the master, seen from each host.
    probe = ("from kvpool.backends.mooncake import load_mooncake_config; import sys; "
             "print(load_mooncake_config(None, {'MOONCAKE_MASTER': sys.argv[1] + ':50088'}).local_hostname)")
    for name in ("B", "C"):
        host = deployment.hosts[name]
        out = host.run([sys.executable, "-c", probe, deployment.hosts["A"].address], env=deployment.env(name),
                       capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == host.address


def _ask(client: httpx.Client, model: str, prompt: list[int]) -> dict:
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                              "temperature": 0.0, "ignore_eos": True, "logprobs": 5,
                                              "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    body["served_by"] = r.headers.get("x-kvpool-instance", "")  # set by the proxy
    return body


def _cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


# "kvpool (tp0 pp0): lookups=1, lookup_hit_blocks=2, load_blocks=2, ..." (logged every 10 s)
_STATS = re.compile(r"kvpool \(tp0 pp0\): (.*)$", re.M)


def _counters(log: str) -> dict[str, float]:
    """kvpool's counters, summed over the stats lines of an instance's log."""
    total: dict[str, float] = {}
    for m in _STATS.finditer(log):
        for part in m.group(1).split(", "):
            k, _, v = part.partition("=")
            total[k] = total.get(k, 0) + float(v)
    return total


def _segments(d: Deployment) -> dict[str, dict]:
    """The master's segments by the host part of their names (the client's local_hostname)."""
    detail = d.master_json("segments")
    return {s["segment_name"].rsplit(":", 1)[0]: s for s in detail["segments"]}


def test_an_instance_on_one_host_hits_exactly_what_another_computed(deployment, reference):
    d = deployment
    address = {h.address: name for name, h in d.hosts.items()}
    ref_cold, ref_hit = reference.generate([PROMPT, PROMPT], max_tokens=MAX_TOKENS)
    assert ref_hit["num_cached_tokens"] == whole(PROMPT)

    # Each vLLM worker mounted one segment, named by (and reached at) its host's own address.
    segments = _segments(d)
    assert set(segments) == {d.hosts["B"].address, d.hosts["C"].address}, segments
    for host, seg in segments.items():
        assert seg["te_endpoint"].rsplit(":", 1)[0] == host, seg
        assert seg["allocator_used_bytes"] == 0, seg

    proxy_url = f"http://{d.hosts['A'].address}:{PORT['proxy']}"
    with httpx.Client(base_url=proxy_url, timeout=300, trust_env=False) as client:
        first = _ask(client, d.model, PROMPT)
        writer = first["served_by"].rsplit(":", 1)[0]
        assert address.get(writer) in ("B", "C"), first["served_by"]
        assert _cached(first) == 0, first["usage"]
        assert first["choices"][0]["token_ids"] == ref_cold["token_ids"]

        d.writer = writer
        # Every key the writer stored is in the writer's own segment (prefer_alloc_in_same_node),
        # once its host pool wrote them through (in the background, just after the request).
        deadline = time.monotonic() + 30
        while len(keys := d.run("keys", "A").split()) < whole(PROMPT) // BLOCK and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(keys) >= whole(PROMPT) // BLOCK, keys
        for key in keys:
            where = d.master_json("where", KEY=key)
            assert where["success"], where
            assert {r["transport_endpoint_"].rsplit(":", 1)[0] for r in where["data"]} == {writer}, where

        second = _ask(client, d.model, PROMPT)
        reader = second["served_by"].rsplit(":", 1)[0]
        assert address.get(reader) in ("B", "C") and reader != writer, (first["served_by"], second["served_by"])
        d.reader = reader
        assert _cached(second) == whole(PROMPT), second["usage"]
        assert second["choices"][0]["token_ids"] == ref_hit["token_ids"]
        # The reader stored nothing itself (its blocks were all in the pool), and every key was
        # in the writer's segment when it asked: what it loaded came out of the writer's
        # segment, on the other host. (The writer's segment is not asked about again: on a
        # starved machine its client can miss the master's heartbeat deadline, and the master
        # then drops the segment and the client mounts it again, empty, after the read.)
        segments = _segments(d)
        assert segments[reader]["allocator_used_bytes"] == 0, segments

        third = _ask(client, d.model, PROMPT)  # round_robin: the writer again, its own prefix cache
        assert third["served_by"] == first["served_by"]
        assert _cached(third) == whole(PROMPT), third["usage"]
        assert second["choices"][0]["logprobs"] == third["choices"][0]["logprobs"]
        assert second["choices"][0]["token_ids"] == third["choices"][0]["token_ids"]

    # The reader's own counters say the same: one lookup, the whole blocks loaded, none
    # failed. kvpool logs them at most every 10 s (stats_log_interval_s): wait for the line.
    deadline = time.monotonic() + 15
    while (counters := _counters(d.instances[reader].log())).get("load_blocks", 0) == 0 \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert counters["load_blocks"] == counters["lookup_hit_blocks"] == whole(PROMPT) // BLOCK, counters
    assert counters["load_failed_blocks"] == 0 and counters["save_blocks"] == 0, counters


def _remote_hits(d: Deployment, host: str, at_least: float = 0) -> float:
    """The instance's `vllm:kvpool_remote_tier_blocks{result="hit"}`, once it reached `at_least`
    (vLLM gathers the workers' counters at its next step's end)."""
    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(f"http://{host}:{PORT['instance']}/metrics", timeout=10, trust_env=False).text
        hits = parse_metric(text, "vllm:kvpool_remote_tier_blocks_total", result="hit")
        if hits >= at_least or time.monotonic() > deadline:
            return hits


def _ask_again(d: Deployment, host: str) -> dict:
    """The prompt on `host`'s instance, with its vLLM prefix cache cleared first: a pool lookup."""
    with httpx.Client(base_url=f"http://{host}:{PORT['instance']}", timeout=300, trust_env=False) as client:
        r = client.post("/reset_prefix_cache")
        assert r.status_code == 200, r.text
        return _ask(client, d.model, PROMPT)


def test_the_reader_hits_its_own_host_pool_then_mooncake_once_the_writers_pool_is_gone(deployment, reference):
    d = deployment
    assert d.writer and d.reader, "runs after test_an_instance_on_one_host_hits_exactly_what_another_computed"
    ref_hit = reference.generate([PROMPT, PROMPT], max_tokens=MAX_TOKENS)[1]
    blocks = whole(PROMPT) // BLOCK
    through_mooncake = _remote_hits(d, d.reader, at_least=blocks)
    assert through_mooncake == blocks  # the reader's first hit came through the remote tier

    local = _ask_again(d, d.reader)
    assert _cached(local) == whole(PROMPT), local["usage"]
    assert local["choices"][0]["token_ids"] == ref_hit["token_ids"]
    assert _remote_hits(d, d.reader) == blocks  # from its own host pool: Mooncake not asked

    d.pools[d.writer].kill()  # the writer's host pool is gone; its vLLM (and segment) stays
    d.pools[d.reader].stop(grace_s=20)  # the reader's restarts empty
    fresh = d.start("server", {h.address: n for n, h in d.hosts.items()}[d.reader], timeout=30)
    fresh.wait_ready()
    d.pools[d.reader] = fresh
    again = _ask_again(d, d.reader)
    assert _cached(again) == whole(PROMPT), again["usage"]
    assert again["choices"][0]["token_ids"] == ref_hit["token_ids"]
    assert _remote_hits(d, d.reader, at_least=2 * blocks) == 2 * blocks  # from Mooncake again
