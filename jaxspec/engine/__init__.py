"""The decode engine: the jitted speculative loop and everything it runs on.

loop (prefill, rounds, the one `lax.while_loop`), loop_config (K, the verify width and the capacity,
resolved once), verify (the K-wide target forward), sampling (device-side choice and acceptance,
`SamplingParams`), programs and compile_cache (compiling ahead and on disk), generate (the API:
`generate`, `make_generate`, `plan`), streaming (rounds as they complete), batching (the continuous
batch engine over a paged KV pool), memory (what a batch needs, checked before anything loads).
"""
