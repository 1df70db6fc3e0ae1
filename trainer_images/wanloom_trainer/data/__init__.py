"""Training data: precomputed Wan latents in WebDataset shards, a shape index, and a plan-following loader.

Entry points (numpy only; torch/diffusers are imported by ``prepare`` alone, google-cloud-storage on first gs://
access):

- ``open_dataset(uri, index=None, *, max_bad_samples, on_skip=None)`` → :class:`LatentDataset` with
  ``num_samples``, ``latent_shapes`` [n, 3], ``sample_shapes()`` (the planner's input) and ``load(ids, shape)``;
- :class:`PlanPrefetcher` loads a rank's planned micro-batches ahead of the step and checkpoints its position;
- ``ensure_synthetic(spec.data, variant)`` generates the local run's synthetic dataset when it is missing;
- ``prepare`` / ``synthetic.write_synthetic`` build datasets (``wanloom data prepare`` / ``wanloom data synth``).

The format is documented in docs/data-format.md.
"""

from wanloom_trainer.data.index import DatasetHeader, ShapeIndex
from wanloom_trainer.data.prefetch import LoadedMicroBatch, PlanPrefetcher, StepData
from wanloom_trainer.data.reader import LatentBatch, LatentDataset, open_dataset, read_index
from wanloom_trainer.data.skips import TooManyBadSamples
from wanloom_trainer.data.synthetic import ensure_synthetic, write_synthetic

__all__ = [
    "DatasetHeader",
    "LatentBatch",
    "LatentDataset",
    "LoadedMicroBatch",
    "PlanPrefetcher",
    "ShapeIndex",
    "StepData",
    "TooManyBadSamples",
    "ensure_synthetic",
    "open_dataset",
    "read_index",
    "write_synthetic",
]
