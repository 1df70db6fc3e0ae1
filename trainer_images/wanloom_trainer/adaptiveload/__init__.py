"""AdaptiveLoad: cost-aware batch sizing and per-step balancing of mixed image/video training across ranks.

Pure numpy/scipy (a shape benchmark on this machine runs the job's backend: ``train.bench_step``, imported lazily).
The map, by stage (each stage imports only those above it in this list):

- ``sizing/``: ``shape_index`` (``SampleShapes``, the planner's view of a dataset), ``tokens`` (sequence length per
  latent shape), ``buckets`` (configured or derived), ``batch_size`` (the paper's dual-constraint rule, equal tokens).
- ``cost/``: ``cost_model`` (step-time models), ``shape_bench`` (their fit to timed real steps, and storage),
  ``cost_source`` (which one a run uses), ``refit`` (the online refit from the run's own slot timings).
- ``plan``: the ``StepPlan``/``RankPlan``/``MicroBatch`` contract with the trainers and the loss normalisation.
- ``assignment/``: ``scheduler`` (the sample stream, bucket chunks), ``balance`` (per-rank totals), ``lockstep``
  (per-slot balance for FSDP), ``packing`` (two-shape packed rows for SPMD), ``layout`` (rows → micro-batches, a
  window's slots → steps).
- ``planner``: ``Planner`` and ``plan_step``, composing the stages for a run.
- ``comparison/``: ``compare`` (against the bucket sampler over one stream, and what the steps train), ``simulate``
  (synthetic shape mixes), ``report`` (``wanloom plan``).
- ``metrics``: per-step load metrics.
"""

from wanloom_trainer.adaptiveload.plan import MicroBatch, RankPlan, StepPlan
from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner, plan_step
from wanloom_trainer.adaptiveload.sizing.shape_index import SampleShapes

__all__ = ["MicroBatch", "PlanConfig", "Planner", "RankPlan", "SampleShapes", "StepPlan", "plan_step"]
