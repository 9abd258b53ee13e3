"""vLLM plugin entry point (`vllm.general_plugins`): registers the connector by name.

vLLM loads general plugins in every process at start-up, so `"kv_connector": "KVPoolConnector"`
(or the spec's `"AscendStoreConnector"`, unless another package registered it) needs no
`kv_connector_module_path`.
"""

from __future__ import annotations

import logging

from kvpool.versions import release_lines, supported

logger = logging.getLogger(__name__)


def register() -> None:
    from vllm import __version__ as vllm_version
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if not supported(vllm_version):
        logger.warning("kvpool supports vLLM %s; this is vLLM %s (`make test-compat` tests each supported "
                       "release)", release_lines(), vllm_version)
    for name in ("KVPoolConnector", "AscendStoreConnector"):
        if name in KVConnectorFactory._registry:
            continue
        KVConnectorFactory.register_connector(name, "kvpool.vllm.connector", "KVPoolConnector")
