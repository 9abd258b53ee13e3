"""The tested model matrix of docs/models.md, generated from what a `make test-models` run saw.

`make test-models` runs the model tests with KVPOOL_MODEL_MATRIX set: every engine a test starts
records its model (the spec it was built from), the KV cache groups vLLM made of it and what
kvpool pools of each; every test records its outcome (harness.py, conftest.py). This script
turns those records into docs/model-matrix.json and the table in docs/models.md between the
`model-matrix` markers, so the table says what was run, on what, with what result:

    python tests/vllm/model_matrix.py --run        # run the model tests, then write both (make test-models)
    python tests/vllm/model_matrix.py RECORDS      # write both from a run's records
    python tests/vllm/model_matrix.py --check      # the table matches the JSON (a unit test)

A family vLLM-CPU cannot prefix-cache has no engine to record; `NOT_RUN` lists it with vLLM's
reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "models.md"
MATRIX = ROOT / "docs" / "model-matrix.json"
BEGIN, END = "<!-- model-matrix:begin -->", "<!-- model-matrix:end -->"
RECORDS = ROOT / "build" / "model-matrix.jsonl"
# The modules `make test-models` runs (the model matrix, and the long real-vLLM runs).
MODULES = [
    "tests/vllm/test_hybrid_models.py", "tests/vllm/test_state_models.py", "tests/vllm/test_kv_cache_dtypes.py",
    "tests/vllm/test_models_pd.py", "tests/vllm/test_tp_sizes.py", "tests/vllm/test_mla_models.py",
    "tests/vllm/test_bf16.py", "tests/vllm/test_compose_and_tp.py::test_tensor_parallel_two_ranks_share_a_server",
    "tests/vllm/test_chaos.py",
]
NOT_RUN = {
    "Mamba2 hybrids (`granite`: Granite 4's pattern)": (
        "not on vLLM-CPU 0.32, which itself fails on them with prefix caching on (its CPU SSD kernel ignores "
        "the in-chunk checkpoint vLLM asks for, and the first prefill that crosses a block raises "
        "`IndexError`; kvpool needs prefix caching for any state model). `make test-compat` runs `granite` "
        "through the pool on vLLM-CPU 0.31.0 and 0.30.0, which serve it: cold = vLLM alone, hit = vLLM's own "
        "prefix-cache hit, tokens and top-5 logprobs"),
    "Jamba (Mamba1 hybrid)": (
        "vLLM-CPU 0.32 has no selective-scan kernel (`torch.ops._C.selective_scan_fwd` is missing): "
        "the model does not start"),
    "DeepSeek V3.2-style sparse attention (indexer cache)": (
        "vLLM-CPU 0.32 refuses sparse attention at start-up (\"Sparse Attention is not supported on CPU\"); "
        "its indexer cache would be one more group, which kvpool refuses by vLLM's spec class until it has its rule"),
}
_SPEC_NAMES = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding", "ChunkedLocalAttentionSpec": "chunked",
               "MLAAttentionSpec": "MLA", "MambaSpec": "state"}


def _spec_name(model: dict) -> str:
    """The `--spec` name of a model as built (its marker's fields)."""
    sys.path.insert(0, str(ROOT / "src"))
    from kvpool.testing.model import SPECS

    for name, spec in SPECS.items():
        if dataclasses.asdict(spec) == model:
            return name
    return f"{model['family']} (unnamed spec)"


def _layers(model: dict) -> str:
    from kvpool.testing.model import ModelSpec

    kinds = ModelSpec(**model).layer_types
    words = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "state"}
    counts = {words[k]: kinds.count(k) for k in dict.fromkeys(kinds)}
    return ", ".join(f"{n} {k}" for k, n in counts.items())


def _groups(groups: list[dict]) -> str:
    """vLLM's groups, alike ones counted: '5 × sliding w256 (1 layer), 1 × full (1 layer); 128-token blocks'."""
    seen: dict[str, int] = defaultdict(int)
    for g in groups:
        window = f" w{g['window']}" if g["window"] else ""
        seen[f"{_SPEC_NAMES.get(g['spec'], g['spec'])}{window} ({g['layers']} layer{'s' * (g['layers'] > 1)})"] += 1
    sizes = sorted({g["block_size"] for g in groups})
    return f"{', '.join(f'{n} × {k}' for k, n in seen.items())}; {'/'.join(map(str, sizes))}-token blocks"


def _make_test_ids() -> set[str]:
    """The matrix's tests that `make test` runs too (its second pass, without KVPOOL_TEST_FAMILIES)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", "-m", "vllm and not models",
         *MODULES], cwd=ROOT, capture_output=True, text=True,
        env={k: v for k, v in os.environ.items() if k not in ("KVPOOL_TEST_FAMILIES", "KVPOOL_MODEL_MATRIX")})
    return {line.strip() for line in out.stdout.splitlines() if "::" in line}


def collect(records_path: Path) -> dict:
    """The matrix of one run's records: per family, its groups, what was pooled, each test's outcome."""
    records = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
    engines = [r for r in records if "model" in r and r["model"]]
    outcomes: dict[str, str] = {}
    for r in records:
        if "outcome" in r and outcomes.get(r["test"]) in (None, "passed"):
            outcomes[r["test"]] = r["outcome"]
    make_test = _make_test_ids()
    families: dict[str, dict] = {}
    for e in engines:
        name = _spec_name(e["model"])
        fam = families.setdefault(name, {"family": e["model"]["family"], "layers": _layers(e["model"]),
                                         "groups": None, "pooled": None, "tests": {}, "engines": []})
        if e["groups"] and (fam["groups"] is None or e.get("connector")):
            fam["groups"] = e["groups"]  # as vLLM made them with a connector configured, where one ran
        if e["pooled"]:
            fam["pooled"] = e["pooled"]
        if _engine_label(e) not in fam["engines"]:
            fam["engines"].append(_engine_label(e))
    by_module: dict[str, set[str]] = defaultdict(set)
    for e in engines:
        by_module[e["test"].split("::")[0]].add(_spec_name(e["model"]))
    for test, outcome in sorted(outcomes.items()):
        module = test.split("::")[0]
        params = test.rsplit("[", 1)[1].rstrip("]").split("-") if "[" in test else []
        names = by_module.get(module, set())
        mine = [n for n in names if n in params or families[n]["family"] in "-".join(params)] or sorted(names)
        for n in mine:
            fam = families[n]
            fam["tests"][test] = {"outcome": outcome, "make_test": test in make_test}
    for fam in families.values():
        fam["engines"].sort()
    return {"vllm": _vllm_version(), "machine": _cpu(), "date": datetime.date.today().isoformat(),
            "families": families}


def _engine_label(e: dict) -> str:
    """How an engine ran the model: vLLM alone, or kvpool on which backend, TP, cache dtype."""
    if "label" in e:
        return e["label"]
    parts = [f"kvpool {e['backend']}" if e["connector"] else "vLLM alone"]
    if e["tp"] != 1:
        parts.append(f"TP={e['tp']}")
    if e["kv_cache_dtype"] != "auto":
        parts.append(e["kv_cache_dtype"])
    return ", ".join(parts)


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        return "unknown"


def _cpu() -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from host import cpu_model  # benchmarks/host.py: the machine facts benchmarks report

    return cpu_model() or platform.processor() or "unknown"


def render(matrix: dict) -> str:
    """The markdown table of a matrix (docs/models.md holds exactly this between the markers)."""
    lines = [
        f"Generated by `make test-models` (vLLM-CPU {matrix['vllm']}, {matrix['machine']}, {matrix['date']}) "
        "from `docs/model-matrix.json`.",
        "",
        "| family (`--spec`) | layers | KV cache groups vLLM makes | pooled by kvpool | ran as | tests (passed / run; in `make test`) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, fam in sorted(matrix["families"].items(), key=lambda kv: kv[0]):
        tests = fam["tests"]
        modules: dict[str, list[dict]] = defaultdict(list)
        for test, t in tests.items():
            modules[Path(test.split("::")[0]).stem].append(t)
        verified = "; ".join(
            f"{m}: {sum(t['outcome'] == 'passed' for t in ts)}/{len(ts)}"
            f" ({sum(t['make_test'] for t in ts)})" for m, ts in sorted(modules.items()))
        groups = _groups(fam["groups"]) if fam["groups"] else "– (engine core in another process)"
        pooled = ", ".join(dict.fromkeys(fam["pooled"])) if fam["pooled"] else "–"
        lines.append(f"| {fam['family']} (`{name}`) | {fam['layers']} | {groups} | {pooled} | "
                     f"{'; '.join(fam['engines'])} | {verified} |")
    for name, why in NOT_RUN.items():
        lines.append(f"| {name} | – | – | – | not run | {why} |")
    return "\n".join(lines)


def _doc_table(text: str) -> str:
    m = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    if m is None:
        raise SystemExit(f"{DOC}: no {BEGIN} ... {END} section; add the markers where the table goes")
    return m.group(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("records", nargs="?", type=Path, help="the JSON lines a KVPOOL_MODEL_MATRIX run wrote")
    ap.add_argument("--run", action="store_true", help="run the model tests (pytest arguments may follow) and write both")
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/models.md's table is not docs/model-matrix.json's")
    args, pytest_args = ap.parse_known_args(argv)
    status = 0
    if args.run:
        RECORDS.parent.mkdir(exist_ok=True)
        RECORDS.unlink(missing_ok=True)
        env = {**os.environ, "KVPOOL_TEST_FAMILIES": "all", "KVPOOL_MODEL_MATRIX": str(RECORDS)}
        status = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                                 *pytest_args, *MODULES], cwd=ROOT, env=env).returncode
        args.records = RECORDS
    elif pytest_args:
        ap.error(f"unknown arguments {pytest_args} (pytest arguments go after --run)")
    if args.check:
        ok = _doc_table(DOC.read_text()) == render(json.loads(MATRIX.read_text()))
        print("docs/models.md's model matrix matches docs/model-matrix.json" if ok else
              "docs/models.md's model matrix differs from docs/model-matrix.json: run `make test-models`")
        return 0 if ok else 1
    if args.records is None:
        ap.error("give the records file, or --check")
    matrix = collect(args.records)
    MATRIX.write_text(json.dumps(matrix, indent=1, sort_keys=True) + "\n")
    text = DOC.read_text()
    DOC.write_text(text.replace(_doc_table(text), render(matrix)))
    print(render(matrix))
    return status


if __name__ == "__main__":
    sys.exit(main())
