"""Pool keys: format, layout fingerprint, TP sharing, PP stages and model names."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys

import pytest

from kvpool.keys import KeyScheme, LayoutInfo, model_key_name

BASE = LayoutInfo(
    dtype="bfloat16",
    block_size=16,
    block_shape=(2, 16, 128),
    num_layers_total=4,
    cache_layout="cpu:FullAttentionSpec",
)
HASH = hashlib.sha256(b"block 0").digest()  # vLLM's sha256 block hashes are 32 bytes
KEY_RE = re.compile(
    r"^(?P<model>[A-Za-z0-9._-]+)@(?P<layout>[0-9a-f]{12})@tp(?P<shard>\d+)/(?P<shards>\d+)"
    r"@pp(?P<pp>\d+)/(?P<pp_size>\d+)@g(?P<group>\d+)@(?P<hash>[0-9a-f]+)$"
)


# ---------------------------------------------------------------------------------------------
# key format


def test_key_format():
    scheme = KeyScheme(model="llama", layout="0123456789ab", tp_rank=1, tp_size=2, kv_shards=2,
                       pp_rank=1, pp_size=2, group=0)
    assert scheme.key(HASH) == f"llama@0123456789ab@tp1/2@pp1/2@g0@{HASH.hex()}"
    m = KEY_RE.match(scheme.key(HASH))
    assert m is not None
    assert bytes.fromhex(m["hash"]) == HASH


def test_defaults_are_one_rank():
    assert KeyScheme(model="m", layout="f").key(b"\x01\xff") == "m@f@tp0/1@pp0/1@g0@01ff"


def test_group_is_in_the_key():
    a = KeyScheme(model="m", layout="f", group=0).key(HASH)
    b = KeyScheme(model="m", layout="f", group=1).key(HASH)
    assert a != b and "@g1@" in b


def test_keys_preserve_order_and_distinguish_blocks():
    hashes = [hashlib.sha256(bytes([i])).digest() for i in range(5)]
    scheme = KeyScheme(model="m", layout="f")
    keys = scheme.keys(hashes)
    assert keys == [scheme.key(h) for h in hashes]
    assert len(set(keys)) == 5


def test_explicit_shard_and_stage_override_this_ranks():
    scheme = KeyScheme(model="m", layout="f", tp_rank=0, tp_size=2, kv_shards=2, pp_rank=0, pp_size=2)
    assert scheme.key(HASH, shard=1, pp_rank=1) == f"m@f@tp1/2@pp1/2@g0@{HASH.hex()}"


# ---------------------------------------------------------------------------------------------
# layout fingerprint


def test_fingerprint_is_short_hex_and_deterministic():
    fp = BASE.fingerprint()
    assert re.fullmatch(r"[0-9a-f]{12}", fp)
    assert LayoutInfo(**dataclasses.asdict(BASE)).fingerprint() == fp


def test_fingerprint_is_pinned():
    # Changing how the fingerprint is computed orphans every pooled block: do it on purpose only.
    assert BASE.fingerprint() == "81fc96ce23b9"


def test_what_computes_the_values_changes_the_fingerprint():
    assert BASE.fingerprint(values="") == BASE.fingerprint()
    fps = {BASE.fingerprint(), BASE.fingerprint(values='{"quantization": null}'),
           BASE.fingerprint(values='{"quantization": "fp8"}')}
    assert len(fps) == 3


def test_fingerprint_is_the_same_in_another_process_with_another_hash_seed():
    code = (
        "from kvpool.keys import LayoutInfo;"
        "print(LayoutInfo('bfloat16', 16, (2, 16, 128), 4, 'cpu:FullAttentionSpec').fingerprint())"
    )
    outs = set()
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                text=True).stdout.strip())
    assert outs == {BASE.fingerprint()}


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "float16"},
        {"dtype": "float32"},
        {"block_size": 32},
        {"block_shape": (1, 16, 128)},  # other KV heads per rank
        {"block_shape": (2, 16, 64)},  # other head size
        {"block_shape": (2, 128, 16)},  # same bytes, other arrangement
        {"num_layers_total": 5},
        {"cache_layout": "cuda:FullAttentionSpec"},
    ],
)
def test_fingerprint_changes_with_what_makes_bytes_incompatible(change):
    assert dataclasses.replace(BASE, **change).fingerprint() != BASE.fingerprint()


def test_fingerprints_of_all_variants_are_distinct():
    variants = [
        dataclasses.replace(BASE, dtype=d, block_size=b, num_layers_total=n)
        for d in ("bfloat16", "float16", "float32")
        for b in (16, 32, 128)
        for n in (2, 4, 32)
    ]
    assert len({v.fingerprint() for v in variants}) == len(variants)


# ---------------------------------------------------------------------------------------------
# tensor parallelism: ranks holding the same KV heads share one key, one of them writes


def test_tp4_with_two_kv_heads_has_two_shards():
    # worker.py: kv_shards = min(tp_size, total_kv_heads) = 2
    schemes = [KeyScheme(model="m", layout="f", tp_rank=r, tp_size=4, kv_shards=2) for r in range(4)]
    assert [s.shard for s in schemes] == [0, 0, 1, 1]
    assert [r for r, s in enumerate(schemes) if s.is_writer] == [0, 2]
    keys = [s.key(HASH) for s in schemes]
    assert keys[0] == keys[1] and keys[2] == keys[3]
    assert keys[0] != keys[2]
    assert len(set(keys)) == 2
    assert "@tp0/2@" in keys[0] and "@tp1/2@" in keys[2]


def test_every_rank_writes_when_heads_are_split_evenly():
    schemes = [KeyScheme(model="m", layout="f", tp_rank=r, tp_size=4, kv_shards=4) for r in range(4)]
    assert all(s.is_writer for s in schemes)
    assert len({s.key(HASH) for s in schemes}) == 4


def test_mla_one_shard_one_writer():
    schemes = [KeyScheme(model="m", layout="f", tp_rank=r, tp_size=8, kv_shards=1) for r in range(8)]
    assert [s.is_writer for s in schemes] == [True] + [False] * 7
    assert len({s.key(HASH) for s in schemes}) == 1


def test_key_does_not_depend_on_tp_size_when_shards_match():
    # TP 2 with 2 shards and TP 4 with 2 shards hold the same head slices per shard.
    a = KeyScheme(model="m", layout="f", tp_rank=1, tp_size=2, kv_shards=2)
    b = KeyScheme(model="m", layout="f", tp_rank=2, tp_size=4, kv_shards=2)
    assert a.key(HASH) == b.key(HASH)


def test_shards_must_divide_tp_size():
    with pytest.raises(ValueError, match="tp_size=4 is not a multiple of kv_shards=3"):
        KeyScheme(model="m", layout="f", tp_size=4, kv_shards=3)


# ---------------------------------------------------------------------------------------------
# all_rank_keys: a block is a hit only if every shard's and stage's key exists


@pytest.mark.parametrize(("tp_size", "kv_shards", "pp_size"), [(1, 1, 1), (2, 2, 1), (4, 2, 1), (1, 1, 2),
                                                                (4, 2, 3), (8, 1, 2), (4, 4, 4)])
def test_all_rank_keys_counts(tp_size, kv_shards, pp_size):
    per_rank = {}
    for pp in range(pp_size):
        for tp in range(tp_size):
            s = KeyScheme(model="m", layout="f", tp_rank=tp, tp_size=tp_size, kv_shards=kv_shards,
                          pp_rank=pp, pp_size=pp_size)
            per_rank[(tp, pp)] = s.key(HASH)
    all_keys = KeyScheme(model="m", layout="f", tp_size=tp_size, kv_shards=kv_shards,
                         pp_size=pp_size).all_rank_keys(HASH)
    assert len(all_keys) == kv_shards * pp_size
    assert len(set(all_keys)) == len(all_keys)
    # exactly the keys the ranks write, whichever rank asks
    assert set(all_keys) == set(per_rank.values())
    other = KeyScheme(model="m", layout="f", tp_rank=tp_size - 1, tp_size=tp_size, kv_shards=kv_shards,
                      pp_rank=pp_size - 1, pp_size=pp_size)
    assert other.all_rank_keys(HASH) == all_keys


# ---------------------------------------------------------------------------------------------
# model names


def test_hub_name_is_made_key_safe():
    assert model_key_name("meta-llama/Llama-3.1-8B") == "meta-llama_Llama-3.1-8B"
    assert model_key_name("org/a b:c@d") == "org_a_b_c_d"  # '@' separates key fields


def test_local_dir_uses_its_real_path(tmp_path):
    real = tmp_path / "models" / "tiny"
    real.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    expected = model_key_name(os.path.realpath(real))
    assert expected.endswith("models_tiny") or len(expected) == 96  # long tmp dirs get truncated
    assert model_key_name(str(real)) == expected
    # same model through a symlink, a trailing slash or a relative path: same name
    assert model_key_name(str(link)) == expected
    assert "link" not in expected
    assert model_key_name(str(real) + "/") == expected
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert model_key_name("models/tiny") == expected
    finally:
        os.chdir(cwd)


def test_a_name_that_is_not_a_directory_is_not_resolved(tmp_path):
    missing = str(tmp_path / "no" / "such" / "model")
    assert model_key_name(missing) == missing.strip("/").replace("/", "_")


def test_long_name_is_bounded_with_a_hash_suffix():
    long = "org/" + "x" * 300
    name = model_key_name(long)
    assert len(name) <= 96
    assert re.fullmatch(r"x+-[0-9a-f]{16}", name)
    assert name.endswith("-" + hashlib.sha256(long.encode()).hexdigest()[:16])


def test_distinct_long_names_stay_distinct():
    # Same tail (the truncated part is kept from the end), different heads.
    a = model_key_name("org-a/" + "m" * 200)
    b = model_key_name("org-b/" + "m" * 200)
    assert a != b
    assert len(a) <= 96 and len(b) <= 96
    assert model_key_name("org-a/" + "m" * 200) == a  # deterministic


def test_short_names_are_unchanged_up_to_the_bound():
    name = "a" * 96
    assert model_key_name(name) == name
    assert len(model_key_name("a" * 97)) <= 96


def test_keys_are_ascii_and_bounded():
    model = model_key_name("/" + "deep/" * 200 + "model")
    scheme = KeyScheme(model=model, layout=BASE.fingerprint(), tp_rank=7, tp_size=8, kv_shards=8,
                       pp_rank=3, pp_size=4, group=2)
    key = scheme.key(HASH)
    assert key.isascii()
    assert len(key.encode()) <= 1024
    assert KEY_RE.match(key)


def test_non_ascii_model_names_give_ascii_keys():
    name = model_key_name("/models/模型-é")
    assert name.isascii()


def test_a_tenants_keys_name_its_tag_never_its_salt():
    from kvpool.keys import block_of, key_parts, owner_of, tenant_tag

    tag = tenant_tag("a secret salt")
    assert len(tag) == 12 and tag == tenant_tag("a secret salt") != tenant_tag("another") and tenant_tag(None) == ""
    scheme = KeyScheme("model", "fp", tp_size=2, kv_shards=2, group=1)
    key = scheme.key(HASH, tenant=tag)
    assert key.startswith(f"model~{tag}@fp@") and "secret" not in key
    assert owner_of(key) == ("model", tag) and owner_of(scheme.key(HASH)) == ("model", "")
    assert block_of(key) == (1, HASH) and key_parts(key)[1] == HASH.hex()
    assert scheme.all_rank_keys(HASH, tag) == [k.replace("model@", f"model~{tag}@") for k in scheme.all_rank_keys(HASH)]
