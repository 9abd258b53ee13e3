#!/usr/bin/env bash
# The host-shared pool every instance below uses (the spec's mooncake_master, on one host).
source "$(dirname "$0")/common.sh"
exec "$PYTHON" -m kvpool.server.daemon --socket "$KVPOOL_SOCKET" --memory-size "${POOL_SIZE:-4GB}" \
  --eviction_high_watermark_ratio 0.9 --eviction_ratio 0.1 --default_kv_lease_ttl 11000
