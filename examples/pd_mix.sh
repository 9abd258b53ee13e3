#!/usr/bin/env bash
# PD-mixed instance (spec: pd_mix.sh): the pool is its prefix cache. Requests go straight to
# its port; no proxy is needed.
source "$(dirname "$0")/common.sh"
serve "${PORT:-8300}" '{
  "kv_connector": "AscendStoreConnector",
  "kv_role": "kv_both",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {
    "lookup_rpc_port": "'"${LOOKUP_RPC_PORT:-2}"'",
    "backend": "server",
    "server_socket": "'"$KVPOOL_SOCKET"'"
  }
}'
