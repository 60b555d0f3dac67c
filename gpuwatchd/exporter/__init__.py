"""NodeState -> Prometheus metric families (collector) and the memory families (memory)."""
