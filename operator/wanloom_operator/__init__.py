"""The wanloom operator: TrainingJob -> JobSet on TPU v7x slices and NVIDIA GPU nodes."""
