"""``metrale bench``: prefill and decode latency per model shape against transformers
(:mod:`metrale.benchmarks.latency`), offline throughput (:mod:`metrale.benchmarks.throughput`)
and a served model under load (:mod:`metrale.benchmarks.serve`)."""
