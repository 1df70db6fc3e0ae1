"""Typed, framework-free training configuration derived from a TrainingJob."""
