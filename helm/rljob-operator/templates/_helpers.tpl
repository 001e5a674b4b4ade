{{/* Chart name, truncated to the 63 characters of a label value. */}}
{{- define "rljob-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release full name: the release name alone when it already contains the chart name. */}}
{{- define "rljob-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rljob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rljob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rljob-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "rljob-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rljob-operator
{{- end -}}

{{- define "rljob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rljob-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Namespaces the operator watches in namespace scope (default: the release namespace). */}}
{{- define "rljob-operator.watchNamespaces" -}}
{{- $namespaces := .Values.watchNamespaces | default (list .Release.Namespace) -}}
{{- toJson (uniq $namespaces) -}}
{{- end -}}

{{- define "rljob-operator.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/*
What the controller does to RLJobs and their children, and nothing more (read from observe.py,
apply.py, handlers.py and what kopf itself calls):
- rljobs: get (observe), list/watch (kopf), patch (kopf's finalizer and progress annotations),
  delete (ttlSecondsAfterFinished deletes a finished job); status: patch; scale: patch.
- pods: list/watch (observe, kopf's pod events), create+patch (server-side apply), delete.
- services, configmaps, serviceaccounts, roles, rolebindings: list (observe by label),
  create+patch (server-side apply); they go with the RLJob by garbage collection, never deleted here.
  configmaps also watch (workers' progress reports wake the job's reconcile) and get: the workers'
  Role grants configmaps get/patch, which the operator must hold itself (RBAC escalation
  prevention).
- persistentvolumeclaims: get (the job's checkpoint claim, by name), create+patch (server-side
  apply of the per-job claim); it goes with the RLJob by garbage collection, never deleted here.
- rljobs/finalizers: update, so children may carry ownerReferences with blockOwnerDeletion
  (the OwnerReferencesPermissionEnforcement admission plugin checks it).
- secrets: create only (the job's token, created once; AlreadyExists means it is there); never
  get, list, watch or patch.
- podgroups (scheduler-plugins, Volcano): list (observe), create+patch (server-side apply) for
  spec.scheduling.gang.
- events: create (the operator's and kopf's Events), patch (an identical Event repeated only
  bumps the count of the first).
*/}}
{{- define "rljob-operator.workloadRules" -}}
- apiGroups: ["rljob.io"]
  resources: ["rljobs"]
  # update: the one-shot storage migration rewrites each RLJob in the storage version
  verbs: ["get", "list", "watch", "patch", "update", "delete"]
- apiGroups: ["rljob.io"]
  resources: ["rljobs/status", "rljobs/scale"]
  verbs: ["patch"]
- apiGroups: ["rljob.io"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
# get: a child whose name is taken is read to see whether this job owns it (never overwritten
# otherwise)
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "list", "create", "patch"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "create", "patch"]
- apiGroups: ["scheduling.x-k8s.io", "scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "list", "create", "patch"]
# one NetworkPolicy per job: only the job's own pods reach its pods
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["localqueues"]
  verbs: ["get"]
{{- end -}}

{{/*
Cluster-scoped reads, needed in both scopes:
- nodes get: the pods of a NotReady node are replaced;
- customresourcedefinitions list/watch: kopf follows CRDs so that an RLJob CRD installed or
  changed after the operator started is noticed (without it kopf retries and logs 403 errors
  for a minute at start, then never sees a CRD that appears later);
- Kueue ResourceFlavors / WorkloadPriorityClasses and PriorityClasses get: a queued job's pods
  get the admitted flavor's node labels and tolerations, its Workload the priority value.
*/}}
{{- define "rljob-operator.clusterReadRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors", "workloadpriorityclasses"]
  verbs: ["get"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["get"]
{{- if .Values.crdManager.enabled }}
# the operator's own CRD, read only (whether it trusts a new webhook certificate yet): the CRD
# manager writes it, so this account cannot repoint the conversion webhook
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  resourceNames: ["rljobs.rljob.io"]
  verbs: ["get"]
{{- else }}
{{ include "rljob-operator.crdWriteRules" . }}
{{- end }}
{{- end -}}

{{/*
The operator's own CRD only: schema upgrade, conversion webhook address and caBundle, and
status.storedVersions after the storage migration. Held by the operator, or with
crdManager.enabled by the CRD manager alone.
*/}}
{{- define "rljob-operator.crdWriteRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions", "customresourcedefinitions/status"]
  resourceNames: ["rljobs.rljob.io"]
  verbs: ["get", "patch"]
{{- end -}}
