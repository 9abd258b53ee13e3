# Shared settings of the example scripts: the spec's serving flags on this CPU machine.
# Override any of these in the environment.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
# A small random-weight model is built once unless MODEL names a real one.
if [ -z "${MODEL:-}" ]; then
  MODEL="$HERE/../.cache/examples/model"
  mkdir -p "$(dirname "$MODEL")"
  # Several scripts may start at once: one builds, the others wait for it.
  flock "$MODEL.lock" "$PYTHON" -m kvpool.testing.model "$MODEL" --spec tiny >/dev/null
fi
KVPOOL_SOCKET="${KVPOOL_SOCKET:-/tmp/kvpool-examples.sock}"
HOST="${HOST:-127.0.0.1}"
# vLLM-CPU: same thread binding for every instance, and a small KV cache.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
# The spec exports PYTHONHASHSEED=0; kvpool does not need it (vLLM's sha256 block hashes use a
# fixed seed), but setting it is harmless and keeps the scripts close to the spec's.
export PYTHONHASHSEED=0

serve() {  # serve PORT KV_TRANSFER_CONFIG
  exec "$PYTHON" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" \
    --served-model-name "${SERVED_MODEL_NAME:-model}" \
    --host "$HOST" \
    --port "$1" \
    --enforce-eager \
    --no-enable-prefix-caching \
    --tensor-parallel-size 1 \
    --data-parallel-size 1 \
    --max-model-len "${MAX_MODEL_LEN:-4096}" \
    --block-size 128 \
    --max-num-batched-tokens "${MAX_NUM_BATCHED_TOKENS:-4096}" \
    --enable-prompt-tokens-details \
    --kv-transfer-config "$2"
}
