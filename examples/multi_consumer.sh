#!/usr/bin/env bash
# Decode node (spec: multi_consumer.sh): loads what the prefill node put in the pool.
source "$(dirname "$0")/common.sh"
serve "${PORT:-8200}" '{
  "kv_connector": "AscendStoreConnector",
  "kv_role": "kv_consumer",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {
    "lookup_rpc_port": "'"${LOOKUP_RPC_PORT:-1}"'",
    "backend": "server",
    "server_socket": "'"$KVPOOL_SOCKET"'",
    "consumer_is_to_load": true
  }
}'
