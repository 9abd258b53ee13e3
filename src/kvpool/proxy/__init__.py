"""The PD-disaggregation proxy: `kvpool proxy` (also `python -m kvpool.proxy`).

Every completion request goes first to the least-loaded prefill instance with
``max_tokens=1`` (it computes the prompt's KV, which the connector saves to the pool or
hands to a transfer connector), then, unchanged apart from the ``kv_transfer_params`` the
prefill returned, to the least-loaded decode instance, whose answer or stream goes back.

Modules, one job each:

- ``config``   arguments and the validated :class:`~kvpool.proxy.config.ProxyConfig`
               (no web dependencies: ``kvpool --help`` stays light)
- ``intake``   reading a client's body under the size limit, strict JSON, field types
- ``registry`` instances, their load and health state, least-loaded selection (no I/O)
- ``health``   the background ``GET /health`` probe that takes instances in and out of rotation
- ``forward``  building the prefill/decode requests, retries, streaming pass-through
- ``app``      the FastAPI routes, the server and ``main``
"""
