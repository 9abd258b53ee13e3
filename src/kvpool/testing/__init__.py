"""Launchers shared by the demo, the tests and the benchmarks: a small model builder
(`model`), vLLM's OpenAI server and `kvpool server` as subprocesses (`launch`), the real
stores (`services`: Redis, mooncake_master, a Yuanrong worker, Memcache's MetaService) and
port/process helpers (`proc`). Nothing here is imported by the connector or the backends."""
