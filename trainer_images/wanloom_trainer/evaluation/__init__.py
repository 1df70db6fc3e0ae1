"""Judging a run while it trains: validation loss on held-out samples (``validation``) and sample videos with
their contact sheet (``samples``)."""
