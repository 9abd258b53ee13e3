"""The proxy: `kvpool proxy` (also `python -m kvpool.proxy`), for PD disaggregation or in
front of PD-mixed instances (docs/proxy.md).

Every completion request goes first to the least-loaded prefill instance with
``max_tokens=1`` (it computes the prompt's KV, which the connector saves to the pool or
hands to a transfer connector), then, unchanged apart from the ``kv_transfer_params`` the
prefill returned, to the least-loaded decode instance, whose answer or stream goes back.
In PD-mixed mode (``--instance-*``) a request goes once, as it came, to the instance the
routing policy picks (``kvpool.routing``: round_robin, least_loaded, prefix_aware).

Modules, one job each:

- ``config``   arguments and the validated :class:`~kvpool.proxy.config.ProxyConfig`
               (no web dependencies: ``kvpool --help`` stays light)
- ``intake``   reading a client's body under the size limit, strict JSON, field types
- ``registry`` instances, their load and health state, the candidates, least-loaded selection (no I/O)
- ``prefix``   a request's prefix chain, from its prompt or messages
- ``route``    mixed mode's routing decisions (through ``kvpool.routing``) and their counters
- ``health``   the background ``GET /health`` probe that takes instances in and out of rotation
- ``forward``  building the prefill/decode (or mixed) requests, retries, streaming pass-through
- ``app``      the FastAPI routes, the server and ``main``
"""
