"""AdaptiveLoad: cost-aware batch sizing and per-step balancing of mixed image/video training across ranks.

Pure numpy/scipy (a shape benchmark on this machine runs the job's backend: ``train.bench_step``, imported lazily).
One concept per module:

- ``shape_index``: ``SampleShapes(ids, latent_shapes)``, the planner's view of a dataset.
- ``tokens``, ``buckets``: sequence length per sample; shape buckets (configured or derived).
- ``batch_size``: the paper's dual-constraint rule and the equal-token baseline.
- ``cost_model``, ``shape_bench``, ``cost_source``, ``refit``: step-time models, their fit to timed real steps
  and storage, which one a run uses, and its online refit from the run's own slot timings.
- ``balance`` (per-rank totals: LPT + repair), ``lockstep`` (per-slot balance for FSDP), ``scheduler`` (which
  samples make up a step), ``layout`` (micro-batches, padding, dummies), ``planner`` (``Planner``, ``plan_step``).
- ``plan``: the ``StepPlan``/``RankPlan``/``MicroBatch`` contract with the trainers and the loss normalisation.
- ``metrics``, ``simulate``, ``compare``, ``report``: per-step metrics, a synthetic shape mix, the comparison with
  the bucket sampler over one sample stream, ``wanloom plan``.
"""

from wanloom_trainer.adaptiveload.plan import MicroBatch, RankPlan, StepPlan
from wanloom_trainer.adaptiveload.planner import PlanConfig, Planner, plan_step
from wanloom_trainer.adaptiveload.shape_index import SampleShapes

__all__ = ["MicroBatch", "PlanConfig", "Planner", "RankPlan", "SampleShapes", "StepPlan", "plan_step"]
