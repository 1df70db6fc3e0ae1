"""Names shared by the operator (which writes them into pods) and the trainer (which reads them).

The environment contract (docs/startup-contract.md): the operator renders these variables into
every trainer container; ``wanloom_trainer`` reads them in one place at start-up. Values that differ per pod come
from the downward API (JobSet labels and the Job completion index), so one pod template serves every rank.
"""

from __future__ import annotations

# Labels and annotations wanloom puts on what it creates.
LABEL_JOB_NAME = "wanloom.dev/trainingjob"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "wanloom-operator"
LABEL_COMPONENT = "app.kubernetes.io/component"
ANNOTATION_SPEC_HASH = "wanloom.dev/spec-hash"
# The trainer's exit status when its configuration cannot run (a bad spec, a missing file): restarting would fail
# the same way, so the pod failure policy fails the JobSet at once instead of retrying maxRestarts times.
EXIT_CONFIG_ERROR = 3
# 128 + SIGTERM: the trainer was asked to stop (preemption, eviction, a drained node, a peer's SIGTERM) and stopped
# after checkpointing the step it was on; the pod failure policy restarts without counting it against maxRestarts.
EXIT_STOPPED = 143

# Labels and annotations JobSet and Kubernetes put on pods (read through the downward API).
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOBSET_REPLICATEDJOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
JOBSET_COORDINATOR = "jobset.sigs.k8s.io/coordinator"
JOBSET_EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
KUEUE_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
KUEUE_JOB_UID = "kueue.x-k8s.io/job-uid"  # on the Workload Kueue creates for a JobSet: the JobSet's uid
# GKE multi-networking: which extra networks a pod attaches (GPUDirect RDMA on A3 Ultra / A4).
GKE_DEFAULT_INTERFACE = "networking.gke.io/default-interface"
GKE_INTERFACES = "networking.gke.io/interfaces"

# The trainer's environment.
ENV_CONFIG = "WANLOOM_CONFIG"  # path of the mounted TrainingJob YAML
ENV_JOB_NAME = "WANLOOM_JOB_NAME"
ENV_NAMESPACE = "WANLOOM_NAMESPACE"
ENV_METRICS_PORT = "WANLOOM_METRICS_PORT"
ENV_DECODE_WORKERS = "WANLOOM_DECODE_WORKERS"  # data preparation: processes that read and decode media
# Not 9090: that is Prometheus's own port, which a laptop running the local job next to Prometheus already uses.
DEFAULT_METRICS_PORT = 9431
ENV_RUN_DIR = "WANLOOM_RUN_DIR"  # local scratch: synthetic data, plots
ENV_COORDINATOR_ADDRESS = "WANLOOM_COORDINATOR_ADDRESS"  # host:port of process 0
ENV_NUM_SLICES = "WANLOOM_NUM_SLICES"  # replicated-job replicas (TPU slices); 1 on GPU
ENV_SLICE_INDEX = "WANLOOM_SLICE_INDEX"  # job index within the replicated job
ENV_HOSTS_PER_SLICE = "WANLOOM_HOSTS_PER_SLICE"  # pods per slice (Job parallelism)
ENV_HOST_INDEX = "WANLOOM_HOST_INDEX"  # Job completion index
ENV_DEVICES_PER_HOST = "WANLOOM_DEVICES_PER_HOST"
# Seconds the torch launcher gives its workers to checkpoint after SIGTERM before it kills them: inside the pod's
# terminationGracePeriodSeconds, so the launcher still reports the workers' exit status.
ENV_SHUTDOWN_SECONDS = "WANLOOM_SHUTDOWN_SECONDS"

CONFIG_MOUNT_DIR = "/etc/wanloom"
CONFIG_FILE_NAME = "trainingjob.yaml"
RUN_DIR = "/var/run/wanloom"  # the trainer's scratch directory in a pod
GIB_DIR = "/usr/local/gib"  # GKE's gIB NCCL plugin, from the host, with the gib GPU profile
# The pod volumes the operator adds, by name, and where the trainer container mounts them: a TrainingJob may use
# neither the names nor the paths (validation, the CRD's CEL and render all read this table).
OPERATOR_VOLUMES = {"wanloom-config": CONFIG_MOUNT_DIR, "dshm": "/dev/shm", "wanloom-run": RUN_DIR, "gib": GIB_DIR}
JAX_COORDINATOR_PORT = 8476
TORCH_MASTER_PORT = 29500


def global_process_id(slice_index: int, hosts_per_slice: int, host_index: int) -> int:
    """Rank of a pod across all slices: unique, unlike the per-Job completion index (Kubeflow Trainer #3537)."""
    return slice_index * hosts_per_slice + host_index
