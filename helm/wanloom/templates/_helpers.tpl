{{/* Names and labels shared by every template. */}}

{{- define "wanloom.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: the release name, unless it already contains the chart name. */}}
{{- define "wanloom.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "wanloom.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "wanloom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: wanloom
{{- end -}}

{{/* Selector labels of the operator pods (stable across upgrades: never add to them). */}}
{{- define "wanloom.selectorLabels" -}}
app.kubernetes.io/name: {{ include "wanloom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "wanloom.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "wanloom.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "wanloom.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Namespaces the operator serves when it does not watch all of them (fails early on an empty list). */}}
{{- define "wanloom.watchedNamespaces" -}}
{{- if and (not .Values.operator.watch.allNamespaces) (empty .Values.operator.watch.namespaces) -}}
{{- fail "operator.watch.namespaces must list at least one namespace when operator.watch.allNamespaces is false" -}}
{{- end -}}
{{- toJson .Values.operator.watch.namespaces -}}
{{- end -}}

{{/* kopf peering is on when more than one replica runs. */}}
{{- define "wanloom.peering" -}}
{{- if gt (int .Values.operator.replicas) 1 }}true{{ end -}}
{{- end -}}

{{/* What the operator does to TrainingJobs and their children (cluster-wide or per watched namespace). */}}
{{- define "wanloom.operatorRules" -}}
# Exactly the verbs the operator uses (tests/e2e/test_chart_install.py checks them against the API server's
# audit log): kopf watches and patches TrainingJobs (finalizers, its own annotations) and their status.
- apiGroups: ["wanloom.dev"]
  resources: ["trainingjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["wanloom.dev"]
  resources: ["trainingjobs/status"]
  verbs: ["patch"]
# Owner references with blockOwnerDeletion need update on the owner's finalizers subresource.
- apiGroups: ["wanloom.dev"]
  resources: ["trainingjobs/finalizers"]
  verbs: ["update"]
# A changed spec replaces the JobSet (its pod template is immutable): delete, then create.
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The TrainingJob spec reaches the trainer pods as a mounted ConfigMap; children are removed by garbage
# collection through their owner references, so no delete.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
# Kueue owns a queued JobSet's suspend flag: a queued job is suspended and resumed through its Workload.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "patch"]
# Read-only: rank 0's address for progress.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# LatentDatasets: kopf watches and annotates them; the operator writes their status and owns their step Jobs.
- apiGroups: ["wanloom.dev"]
  resources: ["latentdatasets"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["wanloom.dev"]
  resources: ["latentdatasets/status"]
  verbs: ["patch"]
- apiGroups: ["wanloom.dev"]
  resources: ["latentdatasets/finalizers"]
  verbs: ["update"]
# A dataset's plan, encode (Indexed) and finalize Jobs; suspend is a patch; garbage collection deletes them.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end -}}
