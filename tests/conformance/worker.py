"""A conformance worker process: its own backend client, running `workload` against a shared pool.

argv: JSON {"config": extra_config, "worker": i, "workers": n}. Prints "ready" once connected,
waits for a line on stdin (so all workers start together), then prints the result as JSON.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conformance_helpers import workload  # noqa: E402

from kvpool.backends import create_backend  # noqa: E402
from kvpool.config import load_config  # noqa: E402


def main() -> None:
    args = json.loads(sys.argv[1])
    backend = create_backend(load_config(args["config"]), f"conformance-worker-{args['worker']}-{os.getpid()}")
    try:
        print("ready", flush=True)
        sys.stdin.readline()
        result = workload(backend, args["worker"], args["workers"])
    finally:
        backend.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
