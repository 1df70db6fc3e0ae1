"""Building datasets: ``wanloom data prepare`` and a LatentDataset's pods (``pipeline``: media → encoders → shards
via ``writer``). The synthetic datasets of local runs are ``data.synthetic``."""
