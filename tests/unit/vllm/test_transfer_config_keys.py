"""What `kvpool doctor` knows of vLLM without importing it, checked against the installed vLLM."""

from __future__ import annotations

import dataclasses

from vllm.config.kv_transfer import KVTransferConfig

from kvpool.cli.doctor import transfer_config_keys


def test_doctors_list_of_transfer_config_keys_is_the_installed_vllms():
    assert transfer_config_keys() == {f.name for f in dataclasses.fields(KVTransferConfig)}


def test_vllm_refuses_a_key_outside_that_list():
    try:
        KVTransferConfig(kv_connector="KVPoolConnector", kv_conector="KVPoolConnector")  # type: ignore[call-arg]
    except (TypeError, ValueError):
        return
    raise AssertionError("vLLM took an unknown key: doctor must not call it an error")
