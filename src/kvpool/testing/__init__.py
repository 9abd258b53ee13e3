"""Launchers shared by the demo, the tests and the benchmarks: a small model builder
(`model`); vLLM's OpenAI server, `kvpool server` and `kvpool proxy` as subprocesses on one
lifecycle (`launch`); the real stores (`services`: Redis, mooncake_master, a Yuanrong worker,
Memcache's MetaService) and port/process helpers (`proc`). Nothing here is imported by the
connector or the backends."""
