#!/usr/bin/env bash
# The host-shared pool every instance below uses (the spec's mooncake_master, on one host).
source "$(dirname "$0")/common.sh"
exec "$PYTHON" -m kvpool.server.daemon --socket "$KVPOOL_SOCKET" --memory-size "${POOL_SIZE:-4GB}" \
  --eviction-high-watermark-ratio 0.9 --eviction-ratio 0.1 --default-kv-lease-ttl 11000
