"""vLLM plugin entry point (`vllm.general_plugins`): registers the connector by name.

vLLM loads general plugins in every process at start-up, so `"kv_connector": "KVPoolConnector"`
(or the spec's `"AscendStoreConnector"`, unless another package registered it) needs no
`kv_connector_module_path`.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = ("0.32",)


def register() -> None:
    from vllm import __version__ as vllm_version
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if not vllm_version.startswith(SUPPORTED_VLLM):
        logger.warning("kvpool is tested with vLLM %s; this is vLLM %s", "/".join(SUPPORTED_VLLM), vllm_version)
    for name in ("KVPoolConnector", "AscendStoreConnector"):
        if name in KVConnectorFactory._registry:
            continue
        KVConnectorFactory.register_connector(name, "kvpool.vllm.connector", "KVPoolConnector")
