"""`kvpool server`: the host-shared pool daemon around the `store` engine, its wire format
(`protocol`), shared-memory arena (`shm`), client (`client`) and metrics endpoint (`metrics`).

No vLLM or torch here: a vLLM worker reaches it through `kvpool.backends.pool_server`."""
