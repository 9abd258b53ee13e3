"""`kvpool plan` end to end on a small trace file: table, JSON, PNG, and errors that say where."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli.main import main

LINES = [
    {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
    {"timestamp": 100, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 200, "input_length": 600, "output_length": 10, "hash_ids": [4, 5]},
    {"timestamp": 300, "input_length": 1536, "output_length": 10, "hash_ids": [1, 2, 6]},
]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


def test_plan_writes_table_json_and_png(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--memory", "1MB,100%", "--ssd", "0,2MB",
               "--jobs", "1", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert doc["trace"]["block_refs"] == 10 and doc["trace"]["unique_blocks"] == 6
    assert doc["settings"]["block_bytes"] == 512 * 1024
    assert [(p["memory_bytes"], p["ssd_bytes"]) for p in doc["points"]] == \
        [(1 << 20, 0), (1 << 20, 2 << 20), (6 * 512 * 1024, 0), (6 * 512 * 1024, 2 << 20)]
    # A 2-block memory tier at the 0.9 high watermark evicts before its second put: it holds one
    # block, and [1,2] leaves only 2 behind, so [1,2,3] misses at 1. Its 2MB SSD tier (3 files)
    # has 1 and 2 for [1,2,3], and 4, 5 push them out before [1,2,6].
    # The whole working set in memory: every repeated block hits (2 + 2 of 10).
    assert [p["memory"] for p in doc["points"]] == [0, 0, 4, 4]
    assert [p["ssd"] for p in doc["points"]] == [0, 2, 0, 0]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "mem%" in table and "40.0%" in table


def test_plan_cluster_sweep(trace: Path, tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    rc = main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--memory", "4MB", "--instances", "2",
               "--local-cache", "1MB", "--sweep-instances", "--policies", "round_robin,prefix_aware",
               "--jobs", "2", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    points = json.loads(out_json.read_text())["points"]
    assert [(p["policy"], p["instances"]) for p in points] == \
        [("round_robin", 1), ("round_robin", 2), ("prefix_aware", 1), ("prefix_aware", 2)]
    for p in points:
        assert p["blocks"] == 10 * p["instances"]  # replicated traffic: one trace per instance
        assert p["local"] + p["memory"] + p["ssd"] + p["recomputed"] == p["blocks"]
        assert sum(p["served"]) == 4 * p["instances"]
    assert out_png.stat().st_size > 0


@pytest.mark.parametrize(("bad", "where"), [
    ('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, -2]}', "trace.jsonl:3 hash_ids"),
    ('{"timestamp": 0, "input_length": "many", "output_length": 1, "hash_ids": [1]}', "trace.jsonl:3 input_length"),
    ("not json", "trace.jsonl:3"),
])
def test_bad_trace_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str, where: str) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(LINES[0]) + "\n" + json.dumps(LINES[1]) + "\n" + bad + "\n")
    assert main(["plan", str(path), "--kv-bytes-per-token", "1KB", "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert where in err and "fix line 3" in err


def test_bad_flag_values_are_named(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(trace), "--kv-bytes-per-token", "lots"]) == 2
    assert "--kv-bytes-per-token='lots'" in capsys.readouterr().err
    assert main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--memory", "4GB,x"]) == 2
    assert "--memory='x'" in capsys.readouterr().err
    assert main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--instances", "2",
                 "--policies", "random"]) == 2
    assert "--policies='random'" in capsys.readouterr().err
    assert main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--sweep-instances"]) == 2
    assert "--sweep-instances=True" in capsys.readouterr().err


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--kv-bytes-per-token", "--memory", "--ssd", "--instances", "--sweep-instances", "--json", "--plot",
                 "--eviction-policy", "--hosts", "--remote", "--model", "--kv-cache-dtype"):
        assert flag in out


def test_eviction_policy_reaches_the_pool(trace: Path, tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    assert main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--memory", "100%", "--eviction-policy",
                 "s3fifo", "--ssd-policy", "s3fifo", "--ssd", "2MB", "--jobs", "1", "--json", str(out_json)]) == 0
    pool = json.loads(out_json.read_text())["settings"]["pool"]
    assert (pool["eviction_policy"], pool["ssd_policy"]) == ("s3fifo", "s3fifo")


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_output_nowhere_to_write_is_refused_before_the_replay(trace: Path, tmp_path: Path, flag: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "missing" / "out.file"
    assert main(["plan", str(trace), "--kv-bytes-per-token", "1KB", flag, str(target)]) == 2
    captured = capsys.readouterr()
    assert f"{flag}='{target}'" in captured.err and "directory that exists" in captured.err
    assert "hit" not in captured.out  # no replay ran


def test_plan_hosts_and_a_remote_tier(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "hosts.json"
    rc = main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--memory", "100%", "--remote", "0,100%",
               "--instances", "2", "--hosts", "2", "--policies", "round_robin", "--jobs", "1",
               "--json", str(out_json)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "remote%" in table and "hosts" in table
    points = json.loads(out_json.read_text())["points"]
    assert [(p["remote_bytes"] > 0, p["hosts"]) for p in points] == [(False, 2), (True, 2)]
    for p in points:
        assert p["local"] + p["memory"] + p["ssd"] + p["remote"] + p["recomputed"] == p["blocks"] == 10
    alone, shared = points
    # Round robin: [1,2] on host 0, [1,2,3] on host 1, [4,5] on host 0, [1,2,6] on host 1.
    # Without the remote tier host 1 recomputes 1 and 2 once; with it, they come from there.
    assert (alone["memory"], alone["remote"]) == (2, 0)
    assert (shared["memory"], shared["remote"]) == (2, 2)


def test_hosts_need_instances(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--hosts", "2"]) == 2
    assert "--hosts=2" in capsys.readouterr().err
    assert main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--instances", "2", "--hosts", "3"]) == 2
    assert "--hosts=3" in capsys.readouterr().err
    assert main(["plan", str(trace), "--kv-bytes-per-token", "1KB", "--remote", "lots"]) == 2
    assert "--remote='lots'" in capsys.readouterr().err


def _model(tmp_path: Path, name: str, cfg: dict) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_kv_bytes_per_token_from_a_models_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpool.plan.modelkv import kv_bytes_per_token

    dense = _model(tmp_path, "dense", {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                       "hidden_size": 4096, "torch_dtype": "bfloat16"})  # Llama-3-8B's shape
    assert kv_bytes_per_token(dense)[0] == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kv_bytes_per_token(dense, "fp8")[0] == 64 * 1024
    mla = _model(tmp_path, "mla", {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                   "num_attention_heads": 128, "hidden_size": 7168, "dtype": "bfloat16"})
    assert kv_bytes_per_token(mla)[0] == 61 * 576 * 2  # one latent per layer, not K and V
    hybrid = _model(tmp_path, "hybrid", {"text_config": {
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2,
        "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "hidden_size": 2048, "dtype": "bfloat16"}})
    assert kv_bytes_per_token(hybrid)[0] == 2 * 3 * 2 * 256 * 2  # the three attention layers only
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    assert main(["plan", str(trace), "--model", dense, "--memory", "100%", "--jobs", "1"]) == 0
    assert f"{dense}: 131072 KV bytes per token (2 x 32 attention layers x 8 KV heads x 128 x 2 B (bfloat16))" \
        in capsys.readouterr().out


def test_a_model_the_planner_cannot_read_is_named(tmp_path: Path, trace: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(trace), "--model", str(tmp_path / "missing")]) == 2
    assert "--model=" in capsys.readouterr().err
    odd = _model(tmp_path, "odd", {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64,
                                   "dtype": "int4"})
    assert main(["plan", str(trace), "--model", odd]) == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err  # the fix it names
    assert main(["plan", str(trace), "--model", odd, "--kv-bytes-per-token", "1KB"]) == 2
    assert "not both" in capsys.readouterr().err
