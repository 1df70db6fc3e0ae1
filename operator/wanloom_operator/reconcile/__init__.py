"""kopf glue: handlers (handlers.py) over pure status derivation (status.py), child management (children.py),
progress scraping (progress.py) and the single API-calling module (cluster.py). Started by runner.py.
"""
