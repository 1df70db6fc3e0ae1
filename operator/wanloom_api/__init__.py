"""The TrainingJob API: typed models, validation, CRD generation and the names shared with the trainer.

Imports only pydantic and the standard library, so the trainer can depend on it.
"""
