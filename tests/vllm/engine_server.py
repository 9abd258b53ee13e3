"""Runs one vLLM engine in its own process and answers commands on stdin/stdout.

Tests share engines (see conftest.py and each module's fixtures). Separate processes keep
engines from sharing state.

`engine_server.py SPEC_JSON` runs one engine. `engine_server.py --fork-server SOCKET` imports
vLLM once and then forks one engine process per request on SOCKET (the request passes the
engine's spec, its environment and its stdin/stdout): importing vLLM is ~85% of an engine's
start-up here (~10 s of ~12 s on 2 cores), and vLLM itself forks its workers from a process that
imported it the same way. Nothing in the fork server runs vLLM code beyond imports: no thread
pool, no device, no config exists before the fork.

Protocol: one JSON object per line.
- {"prompts": [[token ids], ...], "max_tokens": n}
  -> {"results": [{"token_ids", "logprobs", "num_cached_tokens", "finish_reason", "error"}]}
  Prompts run one at a time, in order (each round's hits depend on the previous round's saves),
  and each to the end: after a request finished, the engine is stepped until vLLM holds no
  finished request any more, i.e. until the connector reported its saves done and its blocks
  were freed. So a request's saves are in the pool before the next request looks it up.
- {"reset_prefix_cache": true} -> {"results": [], "reset": bool}: empty vLLM's prefix cache.
- {"pool_keys": true} -> {"results": [], "pool_keys": [...]}: the keys in the worker's `local`
  pool (an engine with TP=1: its worker runs in this process).
- end of input: shut down and exit.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
import traceback

DRAIN_TIMEOUT_S = 120.0


def _scheduler(llm):
    """vLLM's scheduler when the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def _drain(llm) -> None:
    """Step the engine until no finished request waits for the connector (delayed free)."""
    sched = _scheduler(llm)
    if sched is None:
        return  # a separate engine-core process steps itself
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while sched.has_requests():
        if time.monotonic() > deadline:
            raise RuntimeError(f"requests still held by vLLM after {DRAIN_TIMEOUT_S:.0f} s: {list(sched.requests)}")
        llm.llm_engine.step()
        time.sleep(0.002)


def _pool_keys() -> list[str]:
    """The keys in this process's worker's `local` pool (kvpool's worker half, alone or among a
    MultiConnector's connectors)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    for c in getattr(connector, "_connectors", [connector]):
        worker = getattr(c, "_worker", None)
        engine = getattr(getattr(worker, "backend", None), "engine", None)
        if engine is not None:
            return sorted(engine._debug_snapshot()["objects"])
    raise RuntimeError("no kvpool worker with a local pool in this process")


def _groups(llm) -> dict | None:
    """The KV cache groups vLLM made of the model, and what kvpool pools of each (None where the
    engine core runs in a process of its own): printed at start-up for the model matrix."""
    sched = _scheduler(llm)
    if sched is None:
        return None
    made = []
    for group in sched.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        made.append({
            "spec": type(spec).__name__, "layers": len(group.layer_names), "block_size": spec.block_size,
            "window": getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None),
        })
    connector = getattr(sched, "connector", None)
    # kvpool's scheduler side, alone or among a MultiConnector's connectors
    sides = [getattr(c, "_scheduler", None) for c in getattr(connector, "_connectors", [connector])]
    ours = next((s for s in sides if hasattr(s, "_groups")), None)
    pooled = [g.describe() for g in ours._groups] if ours is not None else None
    return {"groups": made, "pooled": pooled}


def _log_kvpool_to_stdout() -> None:
    """kvpool's records (its counters among them) on stdout, where the test reads them.

    kvpool.vllm hands its records to vLLM's handlers when it is imported after vLLM configured
    its logger; with the engine core in this process it is imported before, and INFO records
    would be lost.
    """
    ours = logging.getLogger("kvpool")
    if ours.handlers:
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def run_engine(spec: dict) -> None:
    _log_kvpool_to_stdout()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**spec)
    out = sys.stdout
    print("GROUPS " + json.dumps(_groups(llm)), flush=True)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("pool_keys"):
            _drain(llm)
            out.write(json.dumps({"results": [], "pool_keys": _pool_keys()}) + "\n")
            out.flush()
            continue
        if cmd.get("reset_prefix_cache"):
            _drain(llm)
            out.write(json.dumps({"results": [], "reset": bool(llm.reset_prefix_cache())}) + "\n")
            out.flush()
            continue
        # A request's own kv_transfer_params reach the connector as an API request's do.
        extra = {"kv_transfer_params": cmd["kv_transfer_params"]} if cmd.get("kv_transfer_params") else None
        sp = SamplingParams(max_tokens=cmd.get("max_tokens", 4), temperature=0.0, logprobs=5, ignore_eos=True,
                            extra_args=extra)
        results = []
        for ids in cmd["prompts"]:
            try:
                o = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
                c = o.outputs[0]
                results.append({
                    "token_ids": list(c.token_ids),
                    "logprobs": [sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])[:5]
                                 for step in (c.logprobs or [])],
                    "num_cached_tokens": o.num_cached_tokens,
                    "finish_reason": c.finish_reason,
                    "error": None,
                })
            except Exception as e:  # a failed request is a result the tests inspect
                results.append({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})
            _drain(llm)
        out.write(json.dumps({"results": results}) + "\n")
        out.flush()
    # stdin closed: shut the engine down as vLLM does at exit (workers, and with them the
    # connector: its saves finish, its backend closes, an SSD tier is flushed), then leave
    # without the interpreter's slow teardown of torch and vLLM.
    llm.llm_engine.engine_core.shutdown()
    out.flush()
    os._exit(0)


def _preload() -> None:
    """What every engine imports, imported once in the fork server."""
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.engine.llm_engine  # noqa: F401
    import vllm.v1.worker.cpu_model_runner  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401


def _recv_request(conn) -> tuple[dict, list[int]]:
    import socket

    _, fds, _, _ = socket.recv_fds(conn, 16, 2)
    chunks = []
    while chunk := conn.recv(1 << 16):
        chunks.append(chunk)
    return json.loads(b"".join(chunks)), fds


def fork_server(path: str) -> None:
    """Accept engine requests on Unix socket `path`; fork an engine process for each.

    Request: the engine's stdin and stdout as two file descriptors, then JSON {"spec", "env"};
    answer: JSON {"pid"}. Engine processes are reaped here; their end is their stdout's EOF.
    """
    import signal
    import socket

    _preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(8)
    srv.settimeout(1.0)
    parent = os.getppid()
    print("READY", flush=True)
    while True:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test run is gone (killed): so are we
                os._exit(0)
            continue
        conn.settimeout(None)
        try:
            req, fds = _recv_request(conn)
        except Exception:
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the engine process
            try:
                srv.close()
                conn.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()  # its own process group, as a process started on its own
                os.environ.clear()
                os.environ.update(req["env"])
                tempfile.tempdir = None  # the server's cached temp directory: the engine's TMPDIR wins
                os.dup2(fds[0], 0)
                os.dup2(fds[1], 1)
                os.dup2(fds[1], 2)
                for fd in fds:
                    os.close(fd)
                run_engine(req["spec"])
            except BaseException:
                traceback.print_exc()
                sys.stdout.flush()
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode())
        conn.close()


if __name__ == "__main__":
    if sys.argv[1] == "--fork-server":
        fork_server(sys.argv[2])
    else:
        run_engine(json.loads(sys.argv[1]))
