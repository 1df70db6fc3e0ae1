"""The operator's own Prometheus metrics (names, help and buckets from ``api.metrics.OPERATOR_METRICS``)."""
