"""The data feed: the spawned data process that plans steps (``plan_ahead``), loads their micro-batches and turns
them into backend inputs (``inputs``), and the held-out split validation reads (``holdout``)."""
