#!/usr/bin/env bash
# The load-balancing proxy in front of the prefill and decode nodes (spec: "start the proxy").
source "$(dirname "$0")/common.sh"
exec "$PYTHON" -m kvpool.proxy \
  --host "$HOST" \
  --port "${PORT:-8000}" \
  --prefiller-hosts "${PREFILLER_HOSTS:-127.0.0.1}" \
  --prefiller-ports ${PREFILLER_PORTS:-8100} \
  --decoder-hosts "${DECODER_HOSTS:-127.0.0.1}" \
  --decoder-ports ${DECODER_PORTS:-8200}
