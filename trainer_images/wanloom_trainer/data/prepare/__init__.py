"""Building datasets: ``wanloom data prepare`` (``pipeline``: media → encoders → shards via ``writer``) and the
synthetic datasets of local runs (``synth``)."""
