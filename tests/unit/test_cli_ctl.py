"""`kvpool ctl`'s own checks, before it calls a server (the calls: tests/server/test_controller.py
and, with a real vLLM instance's blocks, tests/vllm/test_mixed_routing.py)."""

from __future__ import annotations

import pytest

from kvpool.cli.main import main
from kvpool.server.metrics import ADMIN_TOKEN_ENV

URL = "http://127.0.0.1:1"  # nothing listens: every case must stop before calling it


@pytest.mark.parametrize(("args", "said"), [
    (["--token-ids", "1,2,3"], "--block-size is needed"),
    (["--token-ids", "1,x", "--block-size", "2"], "expected integers"),
    (["--token-ids", "1,2,3", "--block-size", "16"], "not one whole block of 16"),
])
def test_a_prompt_that_cannot_be_hashed_says_why(args, said, capsys, monkeypatch):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "x" * 20)
    assert main(["ctl", "--url", URL, "lookup", "--model", "m", *args]) == 1
    assert said in capsys.readouterr().err


def test_without_the_token_nothing_is_sent(capsys, monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    assert main(["ctl", "--url", URL, "clear", "--all"]) == 1
    assert f"set {ADMIN_TOKEN_ENV}" in capsys.readouterr().err


def test_the_hashes_are_vllms_chain(monkeypatch):
    # Whole blocks only, chained: a prompt's first block hashes alike whatever follows it, and a
    # cache_salt changes every block.
    from kvpool.vllm.prompt_hashes import prompt_block_hashes

    a = prompt_block_hashes(list(range(40)), 16)
    b = prompt_block_hashes(list(range(16)) + [7] * 20, 16)
    assert len(a) == len(b) == 2 and a[0] == b[0] and a[1] != b[1]
    salted = prompt_block_hashes(list(range(40)), 16, cache_salt="tenant-a")
    assert salted[0] != a[0] and salted[1] != a[1]
