"""Benchmarking over the OpenAI protocol: `specserve bench` (a concurrency sweep against one server) and
`specserve compare` (the same sweep against one specserve server per configuration).

datasets / prompts   prompt sources: the built-in coding and agentic set, ShareGPT, JSONL, random words
client               one streamed request, timed; the served model; speculation counters from /metrics
runner               the sweep: closed-loop concurrency levels, optional Poisson arrivals, warm-up
report               per-level statistics with vLLM's key names, the terminal table, JSON
server_process       a `specserve serve` subprocess: start, wait for /health, stop the whole group
compare              configurations, one server each, side-by-side table, markdown, plot
options              the sweep's command-line flags
"""
