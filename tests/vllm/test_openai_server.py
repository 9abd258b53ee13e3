"""The spec's deployment, as users run it: vLLM's OpenAI server with the spec's flags.

`"kv_connector": "AscendStoreConnector"` works with no module path (the plugin entry point
registers it), `kv_connector_module_path: "kvpool.vllm"` works too, and two instances on one
host with the same `lookup_rpc_port` are refused at start-up with a message saying so.
"""

from __future__ import annotations

import pytest

from harness import tokens
from kvpool.testing.launch import OpenAIServer, ServerError

pytestmark = pytest.mark.vllm

DOC = tokens(1100, seed=31)  # 8 whole blocks


def spec_config(connector: str = "AscendStoreConnector", **top) -> dict:
    """pd_mix.sh's kv-transfer-config, with the embedded backend instead of Mooncake."""
    return {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"lookup_rpc_port": "1", "backend": "local"},
        **top,
    }


@pytest.fixture(scope="module")
def rpc_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("rpc"))


def _server(model_dir: str, rpc_dir: str, cfg: dict) -> OpenAIServer:
    # The spec's serving flags: --block-size 128 --no-enable-prefix-caching --enforce-eager.
    return OpenAIServer(model_dir, block_size=128, prefix_caching=False, enforce_eager=True,
                        dtype="float32", max_num_batched_tokens=512, kv_transfer_config=cfg,
                        env={"VLLM_RPC_BASE_PATH": rpc_dir}, startup_timeout_s=240)


def test_spec_config_hits_and_same_port_is_refused(model_dir, rpc_dir):
    with _server(model_dir, rpc_dir, spec_config()) as a:
        cold = a.complete(DOC, max_tokens=8)
        hit = a.complete(DOC, max_tokens=8)
        assert cold.cached_tokens == 0
        assert hit.cached_tokens == 8 * 128
        assert hit.token_ids == cold.token_ids
        twin = _server(model_dir, rpc_dir, spec_config())
        with pytest.raises(ServerError):
            twin.start()
        assert "lookup_rpc_port=1 is invalid" in twin.log_path.read_text()
        # The refused instance did not disturb the running one.
        assert a.complete(DOC, max_tokens=8).token_ids == cold.token_ids


def test_module_path_config(model_dir, rpc_dir):
    cfg = spec_config("KVPoolConnector", kv_connector_module_path="kvpool.vllm")
    with _server(model_dir, rpc_dir, cfg) as s:
        cold = s.complete(DOC, max_tokens=8)
        hit = s.complete(DOC, max_tokens=8)
        assert (cold.cached_tokens, hit.cached_tokens) == (0, 8 * 128)
        assert hit.token_ids == cold.token_ids
