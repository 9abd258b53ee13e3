"""kvpool's demo: the spec's PD-mixed deployment on this machine, checked against plain vLLM.

    python -m kvpool.demo.run [--model PATH] [--workdir DIR]

1. Build a small random-weight model (nothing is downloaded) unless `--model` / `MODEL` names one.
2. Start vLLM without any connector and record the reference outputs (prefix caching off, so
   every prompt token is computed).
3. Start one `kvpool server` and two vLLM instances, A and B, as the spec's `pd_mix.sh` starts
   one: `AscendStoreConnector`, `kv_both`, `recompute`, `lookup_rpc_port` 1 and 2, with
   `backend: server` (the host-shared pool) instead of Mooncake.
4. Send the spec's short and long questions, and a long document, to A (round 1), then the same
   to B (round 2): B never computed them, yet every full 128-token block comes from the pool.
5. Print a table and exit non-zero unless the long prompts hit the pool in round two and every
   output equals the reference token for token.

`--backend local` runs the single-instance variant (both rounds on one instance, embedded pool).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvpool.testing.launch import Completion, OpenAIServer, PoolServer, ServerError

# The spec's two curl questions, verbatim.
SHORT_QUESTION = "Hello. I have a question. The president of the United States is"
LONG_QUESTION = (
    "Given the accelerating impacts of climate change—including rising sea levels, increasing "
    "frequency of extreme weather events, loss of biodiversity, and adverse effects on agriculture "
    "and human health—there is an urgent need for a robust, globally coordinated response. However, "
    "international efforts are complicated by a range of factors: economic disparities between "
    "high-income and low-income countries, differing levels of industrialization, varying access to "
    "clean energy technologies, and divergent political systems that influence climate policy "
    "implementation. In this context, how can global agreements like the Paris Accord be redesigned "
    "or strengthened to not only encourage but effectively enforce emission reduction targets? "
    "Furthermore, what mechanisms can be introduced to promote fair and transparent technology "
    "transfer, provide adequate financial support for climate adaptation in vulnerable regions, and "
    "hold nations accountable without exacerbating existing geopolitical tensions or "
    "disproportionately burdening those with historically lower emissions?"
)

BLOCK_SIZE = 128  # the spec's --block-size, also vLLM-CPU's default


def kvpool_transfer_config(lookup_rpc_port: str, backend: str, server_socket: str | None) -> dict[str, Any]:
    """pd_mix.sh's --kv-transfer-config, with a kvpool backend instead of Mooncake."""
    extra: dict[str, Any] = {"lookup_rpc_port": lookup_rpc_port, "backend": backend}
    if server_socket:
        extra["server_socket"] = server_socket
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@dataclasses.dataclass(frozen=True)
class DemoRequest:
    """One of the demo's prompts, sent in every round."""

    name: str
    prompt: str


@dataclasses.dataclass(frozen=True)
class Row:
    """One request of one round on one instance, beside vLLM's own prefix-cache answer to it."""

    request: str
    round: int
    instance: str
    result: Completion
    reference: Completion

    @property
    def poolable_tokens(self) -> int:
        """Tokens the pool can serve: the prompt's full blocks, less the one token vLLM must compute."""
        p = self.result.prompt_tokens
        return min(p // BLOCK_SIZE * BLOCK_SIZE, max(p - 1, 0))

    @property
    def matches(self) -> bool:
        return self.result.token_ids == self.reference.token_ids and self.result.text == self.reference.text


def demo_requests(doc_tokens: int, count_tokens) -> list[DemoRequest]:
    """The spec's questions plus a long document of about `doc_tokens` tokens (0: none)."""
    reqs = [DemoRequest("short question", SHORT_QUESTION), DemoRequest("long question", LONG_QUESTION)]
    if doc_tokens > 0:
        # The long question repeated: positions differ, so every block's KV differs too.
        n = max(1, -(-doc_tokens // max(1, count_tokens(LONG_QUESTION))))
        reqs.append(DemoRequest("long document", "\n\n".join([LONG_QUESTION] * n)))
    return reqs


def _server(model: str, args: argparse.Namespace, log: Path, kv: dict[str, Any] | None,
            env: dict[str, str] | None = None) -> OpenAIServer:
    return OpenAIServer(
        model,
        served_model_name="demo",
        max_model_len=args.max_model_len,
        block_size=BLOCK_SIZE,
        prefix_caching=False,  # as pd_mix.sh: the pool is the only prefix cache
        enforce_eager=True,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_transfer_config=kv,
        env={"PYTHONHASHSEED": "0", **(env or {})},  # pd_mix.sh exports it
        log_path=log,
    )


def _warm_up(srv: OpenAIServer) -> None:
    # The first request of a fresh engine pays one-off costs; keep them out of the TTFTs.
    # It is shorter than one block, so it puts nothing in the pool.
    srv.complete("Warm-up.", max_tokens=2)


def _print_table(rows: list[Row], title: str) -> None:
    headers = ["request", "round", "instance", "prompt tokens", "from pool", "TTFT ms", "ref TTFT ms", "output = ref"]
    cells = [
        [r.request, str(r.round), r.instance, str(r.result.prompt_tokens), str(r.result.cached_tokens),
         f"{r.result.ttft_s * 1e3:.1f}", f"{r.reference.ttft_s * 1e3:.1f}", "yes" if r.matches else "NO"]
        for r in rows
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
        for c in cells:
            print("  ".join(v.ljust(w) for v, w in zip(c, widths)))
        return
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for c in cells:
        table.add_row(*c)
    console = Console()
    if not console.is_terminal:  # piped or logged: do not wrap the table at 80 columns
        console = Console(width=120)
    console.print(table)


def check(rows: list[Row]) -> list[str]:
    """Why the demo failed; empty when it passed."""
    problems = []
    for r in rows:
        if not r.matches:
            problems.append(
                f"{r.request} round {r.round}: output differs from the reference\n"
                f"  got       {r.result.token_ids}\n  reference {r.reference.token_ids}"
            )
        if r.round == 2 and r.poolable_tokens > 0 and r.result.cached_tokens == 0:
            problems.append(f"{r.request} round 2: no tokens served from the pool "
                            f"({r.result.prompt_tokens} prompt tokens, {r.poolable_tokens} poolable)")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("MODEL"),
                   help="model directory (default: $MODEL, else build a random-weight model in the workdir)")
    p.add_argument("--workdir", default=".cache/demo", help="model and logs go here (default: .cache/demo)")
    p.add_argument("--spec", default="tiny", help="size of the model to build when --model is not given (tiny, bench)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per request (spec: 200/256)")
    p.add_argument("--doc-tokens", type=int, default=1500,
                   help="approximate size of the extra long-document request; 0 to leave it out")
    p.add_argument("--dtype", default="auto", help="vLLM --dtype for both servers (auto: bfloat16 on CPU)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--backend", choices=("server", "local"), default="server",
                   help="server: one kvpool server shared by instances A and B (default); "
                        "local: one instance with the embedded pool")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    args = p.parse_args(argv)

    workdir = Path(args.workdir).resolve()
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = args.model
    else:
        from kvpool.testing.model import SPECS, build_model

        if args.spec not in SPECS:
            p.error(f"--spec must be one of {', '.join(sorted(SPECS))}")
        print(f"Building the {args.spec} random-weight model in {workdir / ('model-' + args.spec)} ...", flush=True)
        model = str(build_model(workdir / f"model-{args.spec}", SPECS[args.spec]))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    requests = demo_requests(args.doc_tokens, lambda s: len(tokenizer(s).input_ids))

    # lookup_rpc_port "1" names an IPC socket under VLLM_RPC_BASE_PATH (default: the user's
    # runtime directory); a private directory keeps this demo from clashing with another
    # instance of the same user on the host using port 1.
    rpc_dir = tempfile.mkdtemp(prefix="kvpool-demo-")
    ref_log, log_a, log_b, server_log = (logs / f for f in ("reference.log", "instance-a.log",
                                                          "instance-b.log", "kvpool-server.log"))
    for f in (ref_log, log_a, log_b, server_log):
        f.unlink(missing_ok=True)
    sock = os.path.join(rpc_dir, "kvpool.sock") if args.backend == "server" else None
    try:
        print(f"Starting vLLM without a connector (reference), log {ref_log} ...", flush=True)
        reference: dict[str, Completion] = {}
        with _server(model, args, ref_log, None, {"VLLM_RPC_BASE_PATH": rpc_dir}) as srv:
            _warm_up(srv)
            for req in requests:
                reference[req.name] = srv.complete(req.prompt, args.max_tokens)

        rows: list[Row] = []
        env = {"VLLM_RPC_BASE_PATH": rpc_dir}
        with contextlib.ExitStack() as stack:
            if sock:
                print(f"Starting kvpool server on {sock}, log {server_log} ...", flush=True)
                stack.enter_context(PoolServer(sock, memory_size="2GB", log_path=server_log))
            print(f"Starting vLLM instance A with kvpool as pd_mix.sh does, log {log_a} ...", flush=True)
            a = stack.enter_context(_server(model, args, log_a, kvpool_transfer_config("1", args.backend, sock), env))
            b = a
            if sock:
                print(f"Starting vLLM instance B (lookup_rpc_port 2, same pool), log {log_b} ...", flush=True)
                b = stack.enter_context(_server(model, args, log_b, kvpool_transfer_config("2", args.backend, sock), env))
            for srv in {id(a): a, id(b): b}.values():
                _warm_up(srv)
            for rnd, (name, srv) in ((1, ("A", a)), (2, ("B" if sock else "A", b))):
                for req in requests:
                    rows.append(Row(req.name, rnd, name, srv.complete(req.prompt, args.max_tokens), reference[req.name]))
            # vLLM's own count of connector-supplied tokens, independent of the usage records.
            external_hits = b.metric("vllm:external_prefix_cache_hits_total")
    except ServerError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(rpc_dir, ignore_errors=True)

    print()
    title = ("kvpool demo: instances A and B share one kvpool server (AscendStoreConnector, backend server)"
             if sock else "kvpool demo: one instance, embedded pool (AscendStoreConnector, backend local)")
    _print_table(rows, title)
    print(f"\n'from pool' is usage.prompt_tokens_details.cached_tokens; prefix caching is off, so it counts "
          f"pool hits only\n(vLLM's metric vllm:external_prefix_cache_hits_total on the round-two instance: {external_hits:.0f} tokens). "
          f"Prompts shorter than one {BLOCK_SIZE}-token block have nothing to pool; the long document "
          f"starts with the long question,\nso in round one it already finds that question's full blocks.")
    print(f"Logs: {logs}")
    problems = check(rows)
    if problems:
        print("\nFAILED:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    who = "instance B loaded the blocks instance A computed" if sock else "round two loaded the long prompts' blocks"
    print(f"PASSED: {who} from the pool, and every output equals the reference.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
