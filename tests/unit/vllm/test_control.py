"""A request's own switches for the pool (`kv_transfer_params.kvpool`): read, or ignored with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.vllm.control import DEFAULT, SWITCHES, RequestControl, request_control

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


@pytest.mark.parametrize("params, control", [
    (None, DEFAULT),
    ({"do_remote_decode": True}, DEFAULT),  # another connector's keys only
    ({"kvpool": {}}, DEFAULT),
    ({"kvpool": {"skip_load": True, "save_decode": False}}, RequestControl(skip_load=True, save_decode=False)),
    ({"kvpool": {"pin_s": 90}}, RequestControl(pin_s=90.0)),
])
def test_switches_are_read(params, control):
    assert request_control(params) == (control, None)


@pytest.mark.parametrize("given", [{"skip_load": "true"}, {"skip_lod": True}, [True], "skip_load", 1, None,
                                   {"pin_s": -1}, {"pin_s": 1e9}, {"pin_s": "1h"}])
def test_a_value_kvpool_cannot_read_gives_the_defaults_and_says_why(given):
    control, problem = request_control({"kvpool": given})
    assert control == DEFAULT and problem is not None and "kv_transfer_params.kvpool" in problem


def test_every_switch_is_documented():
    doc = DOC.read_text()
    assert [s for s in SWITCHES if f"| `{s}` |" not in doc] == []
