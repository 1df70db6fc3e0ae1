"""What a micro-batch costs: the cost models, where a run's comes from, shape benchmarks and the online refit."""
