"""kvpool's vLLM integration. `kv_connector_module_path: "kvpool.vllm"` resolves the connector here."""

import logging

from kvpool.vllm.connector import AscendStoreConnector, KVPoolConnector


def _route_logs_to_vllm() -> None:
    """Send kvpool's log records through vLLM's handlers, so they appear in vLLM's log."""
    ours, theirs = logging.getLogger("kvpool"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


_route_logs_to_vllm()

__all__ = ["AscendStoreConnector", "KVPoolConnector"]
