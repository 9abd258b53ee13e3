"""The layering rule, enforced: every import inside kvpool goes down the layers, never up.

    errors, paths, versions, backoff   what everything may use (the vLLM releases kvpool supports;
                             the doubling delay after failures)
    keys, store, routing,    pool keys; the engine (allocator, index, leases, eviction, disk tier);
    tracefile                request routing policies (pure); the request-trace format
    config                   the schemas and their parser
    metrics                  the catalog of exported Prometheus series, and its prometheus_client exporters
    server                   `kvpool server`: daemon, wire format, shared memory, client, metrics
    backends                 registry, base class, one adapter per store
    device                   KV cache tensors <-> pool values: layout, direct and staged copies (torch, no vLLM)
    vllm                     the connector (the only layer that imports vLLM)
    proxy, cli, testing, demo, plan   on top: commands, the PD proxy, launchers, the capacity planner

Imports inside functions count too: a lazy import up the layers is still a cycle in the design.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvpool

SRC = Path(kvpool.__file__).parent
LAYERS = [
    {"errors", "paths", "versions", "backoff"},
    {"keys", "store", "routing", "tracefile"},
    {"config"},
    {"metrics"},
    {"server"},
    {"backends"},
    {"device"},
    {"vllm"},
    {"proxy", "cli", "testing", "demo", "plan"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
# Top-layer packages are independent of each other, but for these uses.
TOP_ALLOWED = {("cli", "proxy"), ("cli", "testing"), ("demo", "testing"), ("cli", "plan")}


def _component(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "kvpool" and len(parts) > 1 else None


def _kvpool_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return [(line, m) for line, m in out if m.startswith("kvpool.")]


def test_every_module_belongs_to_a_layer():
    names = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert names == set(LAYER), f"give these a layer here: {sorted(names ^ set(LAYER))}"


def test_imports_go_down_the_layers_only():
    violations = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        here = rel.parts[0].removesuffix(".py")
        if here == "__init__":
            continue
        for line, module in _kvpool_imports(path):
            there = _component(module)
            if there is None or there == here:
                continue
            up = LAYER[there] > LAYER[here]
            sideways_top = LAYER[there] == LAYER[here] == len(LAYERS) - 1 and (here, there) not in TOP_ALLOWED
            sideways = LAYER[there] == LAYER[here] < len(LAYERS) - 1 and {here, there} != {"errors", "paths"} \
                and {here, there} != {"keys", "store"}
            if up or sideways_top or sideways:
                violations.append(f"{rel}:{line} ({here}) imports {module} ({there})")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_device_layer_imports_torch_but_not_vllm():
    code = (
        "import sys\n"
        "import kvpool.device.layout, kvpool.device.copy\n"
        "print('vllm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_layers_below_vllm_import_neither_vllm_nor_torch():
    code = (
        "import sys\n"
        "import kvpool, kvpool.config, kvpool.errors, kvpool.keys, kvpool.store, kvpool.server.daemon,"
        " kvpool.server.client, kvpool.backends, kvpool.backends.registry, kvpool.cli.doctor\n"
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
