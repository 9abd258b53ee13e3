#!/usr/bin/env bash
# Prefill node (spec: multi_producer.sh). The spec composes AscendStoreConnector with the P2P
# MooncakeConnectorV1 in a MultiConnector; no P2P transfer connector runs on this CPU machine,
# so the decode node gets the prefill's KV through the pool instead (PD through the pool).
# Like the spec's producer it also loads pooled prefixes ("producer_is_to_load": false: save only).
source "$(dirname "$0")/common.sh"
serve "${PORT:-8100}" '{
  "kv_connector": "AscendStoreConnector",
  "kv_role": "kv_producer",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {
    "lookup_rpc_port": "'"${LOOKUP_RPC_PORT:-0}"'",
    "backend": "server",
    "server_socket": "'"$KVPOOL_SOCKET"'"
  }
}'
