{{/*
Names. 40 characters at most, so that "<fullname>-syncer" stays a valid StatefulSet name
and the launcher's pod names "<fullname>-learner-<launch id>" stay DNS labels.
*/}}
{{- define "diloco.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains "diloco" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-diloco" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
The name label is always "diloco": the coordinator's launcher sets it on the pods it
creates, and the NetworkPolicies select on it.
*/}}
{{- define "diloco.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: diloco
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: diloco
{{- end -}}

{{/* (dict "root" $ "component" "syncer") */}}
{{- define "diloco.selectorLabels" -}}
app.kubernetes.io/name: diloco
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "diloco.componentLabels" -}}
{{ include "diloco.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* (dict "root" $ "repository" <repository> "image" <values with tag, digest>) -> repository:tag or @digest */}}
{{- define "diloco.imageRef" -}}
{{- $image := .image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" .repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" .repository ($image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* The chart's image: its repository is the user's registry (no default: a name the
cluster cannot pull would fail every pod with ImagePullBackOff instead of the install). */}}
{{- define "diloco.image" -}}
{{- $repository := required "image.repository is required: the registry path of the image built from k8s/images/Dockerfile (the coordinator, the shards, CPU learners), e.g. --set image.repository=$REGISTRY/diloco (docs/kubernetes.md)" .Values.image.repository -}}
{{- include "diloco.imageRef" (dict "root" . "repository" $repository "image" .Values.image) -}}
{{- end -}}

{{/* The learners' image: learners.images.<accelerator>; CPU learners default to the
chart's image, TPU and GPU learners need their own (torch_xla; a CUDA torch). */}}
{{- define "diloco.learnerImage" -}}
{{- $accelerator := .Values.learners.accelerator -}}
{{- $image := index .Values.learners.images $accelerator -}}
{{- if and (eq $accelerator "cpu") (not $image.repository) -}}
{{- include "diloco.image" . -}}
{{- else -}}
{{- $built := ternary "k8s/images/Dockerfile.tpu" "k8s/images/Dockerfile with a CUDA torch" (eq $accelerator "tpu") -}}
{{- $repository := required (printf "learners.images.%s.repository is required: the registry path of the %s learner image (built from %s), e.g. --set learners.images.%s.repository=$REGISTRY/diloco-%s (docs/kubernetes.md)" $accelerator $accelerator $built $accelerator $accelerator) $image.repository -}}
{{- include "diloco.imageRef" (dict "root" . "repository" $repository "image" $image) -}}
{{- end -}}
{{- end -}}

{{- define "diloco.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "diloco.fullname" .)) -}}
{{- end -}}

{{- define "diloco.tlsSecretName" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "diloco.fullname" .)) -}}
{{- end -}}

{{- define "diloco.serviceAccountName" -}}
{{- printf "%s-coordinator" (include "diloco.fullname" .) -}}
{{- end -}}

{{- define "diloco.coordinatorAddress" -}}
{{- printf "%s-coordinator.%s.svc.%s:%d" (include "diloco.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.coordinator.port) -}}
{{- end -}}

{{/* Every shard's stable address, in shard id order (the coordinator's --shards). */}}
{{- define "diloco.shardAddresses" -}}
{{- $fullname := include "diloco.fullname" . -}}
{{- $addresses := list -}}
{{- range $m := until (int .Values.syncer.shards) -}}
{{- $addresses = append $addresses (printf "%s-syncer-%d.%s-syncer.%s.svc.%s:%d" $fullname $m $fullname $.Release.Namespace $.Values.clusterDomain (int $.Values.syncer.port)) -}}
{{- end -}}
{{- join "," $addresses -}}
{{- end -}}

{{/* The built-in task (diloco.task.DEFAULT_TASK): the byte-level GPT. */}}
{{- define "diloco.builtinTask" -}}
diloco.tasks.byte_gpt:build
{{- end -}}

{{/*
run.taskOptions without the keys set to null: Helm merges a values file's map with a
preset's, and a null is how a key of the preset is dropped (as JSON).
*/}}
{{- define "diloco.taskOptions" -}}
{{- $options := dict -}}
{{- range $key, $value := .Values.run.taskOptions | default dict -}}
{{- if not (kindIs "invalid" $value) -}}
{{- $_ := set $options $key $value -}}
{{- end -}}
{{- end -}}
{{- toJson $options -}}
{{- end -}}

{{/*
The run config as RunConfig.to_json writes it (keys sorted, task options included): the
coordinator and the shards read it, and the coordinator hands it to every learner that joins.
The schema checks the built-in task's option names and numbers; what it cannot say
(heads must divide width, with the task's own defaults 128 and 4) is checked here.
*/}}
{{- define "diloco.runConfig" -}}
{{- $run := .Values.run -}}
{{- $options := include "diloco.taskOptions" . | fromJson -}}
{{- if eq $run.task (include "diloco.builtinTask" .) -}}
{{- $width := get $options "width" | default "128" | atoi -}}
{{- $heads := get $options "heads" | default "4" | atoi -}}
{{- if mod $width $heads -}}
{{- fail (printf "run.taskOptions: width %d must be divisible by heads %d (the built-in byte GPT)" $width $heads) -}}
{{- end -}}
{{- end -}}
{{- dict "task" $run.task "task_options" $options "seed" (int $run.seed) "fragments" (int $run.fragments) "sync_every_steps" (int $run.syncEverySteps) "overlap_steps" (int $run.overlapSteps) "merge_alpha" (float64 $run.mergeAlpha) "reply_rule" $run.replyRule "max_model_bytes" (int64 $run.maxModelBytes) | toJson -}}
{{- end -}}

{{/*
A learner's TPU slice as JSON {chips, chipsPerHost, hosts}: chips = the product of the
topology, hosts = chips / chipsPerHost. The schema knows each accelerator's topologies
and chips per host; what it cannot say is checked here: chipsPerHost must divide the
chips, and GKE builds every multi-host slice from 4-chip hosts (1-chip and 8-chip hosts
only make the single-host 1x1 and 2x4 slices).
*/}}
{{- define "diloco.tpuSlice" -}}
{{- $tpu := .Values.learners.tpu -}}
{{- $chips := 1 -}}
{{- range (splitList "x" $tpu.topology) -}}
{{- $chips = mul $chips (int .) -}}
{{- end -}}
{{- $perHost := int $tpu.chipsPerHost -}}
{{- if mod $chips $perHost -}}
{{- fail (printf "learners.tpu.chipsPerHost %d does not divide the %d chip(s) of learners.tpu.topology %s: set learners.tpu.chipsPerHost to %d (one host) or choose a larger learners.tpu.topology" $perHost $chips $tpu.topology $chips) -}}
{{- end -}}
{{- $hosts := div $chips $perHost -}}
{{- if and (gt $hosts 1) (ne $perHost 4) -}}
{{- fail (printf "learners.tpu.topology %s (%d chips) on hosts of learners.tpu.chipsPerHost %d would be %d hosts, but GKE builds multi-host %s slices from 4-chip hosts only: set learners.tpu.chipsPerHost to 4 (%d hosts)" $tpu.topology $chips $perHost $hosts $tpu.accelerator (div $chips 4)) -}}
{{- end -}}
{{- dict "chips" $chips "chipsPerHost" $perHost "hosts" $hosts | toJson -}}
{{- end -}}

{{/* Hosts (pods) of one learner: the TPU slice's, else 1. */}}
{{- define "diloco.learnerHosts" -}}
{{- if eq .Values.learners.accelerator "tpu" -}}
{{- (include "diloco.tpuSlice" . | fromJson).hosts -}}
{{- else -}}
1
{{- end -}}
{{- end -}}

{{- define "diloco.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "diloco.securityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/*
Environment of every container: the pod's identity from the downward API, then the
OTEL_* variables. (dict "root" $ "service" "diloco-syncer" "attributes" (list "diloco.shard.id=$(SHARD_ID)"))
Kubernetes expands $(VAR) from variables defined earlier in the list.
*/}}
{{- define "diloco.env" -}}
{{- $root := .root -}}
- name: POD_NAME
  valueFrom:
    fieldRef: {fieldPath: metadata.name}
- name: POD_NAMESPACE
  valueFrom:
    fieldRef: {fieldPath: metadata.namespace}
- name: NODE_NAME
  valueFrom:
    fieldRef: {fieldPath: spec.nodeName}
- name: HOME
  value: /tmp
{{- if $root.Values.tls.enabled }}
# diloco reads it as --tls-dir: mutual TLS on every server and channel.
- name: DILOCO_TLS_DIR
  value: /var/run/diloco-tls
{{- else }}
# tls.enabled=false: plaintext gRPC, asked for explicitly (diloco refuses it otherwise).
- name: DILOCO_INSECURE
  value: "1"
{{- end }}
- name: MPLCONFIGDIR
  value: /tmp/matplotlib
- name: OTEL_SERVICE_NAME
  value: {{ .service }}
{{- $attributes := list "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.pod.name=$(POD_NAME)" "k8s.node.name=$(NODE_NAME)" "service.instance.id=$(POD_NAME)" -}}
{{- $attributes = concat $attributes (.attributes | default list) -}}
{{- range $key, $value := $root.Values.otel.resourceAttributes -}}
{{- $attributes = append $attributes (printf "%s=%s" $key (urlquery (toString $value) | replace "+" "%20")) -}}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attributes | quote }}
{{- with $root.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: grpc
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ $root.Values.otel.insecure | quote }}
{{- end }}
{{- with $root.Values.otel.sampler }}
- name: OTEL_TRACES_SAMPLER
  value: {{ . | quote }}
{{- with $root.Values.otel.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- if $root.Values.metrics.enabled }}
- name: OTEL_METRICS_EXPORTER
  value: {{ ternary "otlp,prometheus" "prometheus" (ne $root.Values.otel.endpoint "") }}
- name: OTEL_EXPORTER_PROMETHEUS_HOST
  value: 0.0.0.0
- name: OTEL_EXPORTER_PROMETHEUS_PORT
  value: {{ $root.Values.metrics.port | int | quote }}
{{- end }}
{{- with $root.Values.otel.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Empty unless metrics are on; use as (include ...) in a "with". */}}
{{- define "diloco.metricsPort" -}}
{{- if .Values.metrics.enabled -}}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
  protocol: TCP
{{- end -}}
{{- end -}}

{{/* Prometheus's scrape annotations, on every pod that serves metrics (metrics.scrapeAnnotations). */}}
{{- define "diloco.scrapeAnnotations" -}}
{{- if and .Values.metrics.enabled .Values.metrics.scrapeAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}

{{/* A writable /tmp on a read-only root filesystem (torch, XLA and libtpu write there). */}}
{{- define "diloco.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: 2Gi
{{- end -}}

{{/*
The learner pod, shared by the learner Job and the launcher's pod templates:
(dict "root" $ "pool" "spot" "spot" true "static" false "extra" <pool entry>).
Static learners get --coordinator, --join-token-file and --pool here; the launcher
appends those (and --launch-id) to a template's args itself.

On a multi-host slice the pod is one host of a JobSet's Indexed Job (one JobSet per
slice, diloco.learnerJobSet): it learns its index (0 leads: the one learner toward the
coordinator and the shards) from the Job's completion index, and its leader's address
from the JobSet's name and job index (0, the JobSet's one Job): pod 0 of Job
<jobset>-slice-<job index>, whose hostname the JobSet publishes under the subdomain
<jobset> (network.enableDNSHostnames).

Learners serve no port (they are gRPC clients), so they have no readiness or liveness
probe: what detects a dead or hung learner is the coordinator's heartbeat lease, after
which the shards stop waiting for it.
*/}}
{{- define "diloco.learnerPod" -}}
{{- $root := .root -}}
{{- $v := $root.Values.learners -}}
{{- $extra := .extra | default dict -}}
{{- $hosts := include "diloco.learnerHosts" $root | int -}}
metadata:
  labels:
    {{- include "diloco.selectorLabels" (dict "root" $root "component" "learner") | nindent 4 }}
    app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
    app.kubernetes.io/part-of: diloco
    diloco/pool: {{ .pool }}
  annotations:
    {{- /* A new run config (another task, other options) is a new run: the learner Job's
    (or JobSets') name hashes this pod, so its learners are replaced, not left on the old task. */}}
    checksum/run-config: {{ include "diloco.runConfig" $root | sha256sum }}
    {{- with (include "diloco.scrapeAnnotations" $root) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- if or .static (gt $hosts 1) }}
  restartPolicy: Never
  {{- end }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ ternary $root.Values.scavenging.terminationGracePeriodSeconds $v.terminationGracePeriodSeconds (.spot | default false) }}
  securityContext:
    {{- include "diloco.podSecurityContext" . | nindent 4 }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $selector := dict -}}
  {{- if eq $v.accelerator "tpu" -}}
  {{- $_ := set $selector "cloud.google.com/gke-tpu-accelerator" $v.tpu.accelerator -}}
  {{- $_ := set $selector "cloud.google.com/gke-tpu-topology" $v.tpu.topology -}}
  {{- else if eq $v.accelerator "gpu" -}}
  {{- $_ := set $selector "cloud.google.com/gke-accelerator" $v.gpu.accelerator -}}
  {{- end -}}
  {{- if .spot -}}
  {{- $_ := set $selector "cloud.google.com/gke-spot" "true" -}}
  {{- end -}}
  {{- $selector = merge $selector ($extra.nodeSelector | default dict) $v.nodeSelector }}
  {{- with $selector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- $tolerations := list -}}
  {{- if eq $v.accelerator "tpu" -}}
  {{- $tolerations = append $tolerations (dict "key" "google.com/tpu" "operator" "Exists" "effect" "NoSchedule") -}}
  {{- else if eq $v.accelerator "gpu" -}}
  {{- $tolerations = append $tolerations (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") -}}
  {{- end -}}
  {{- if .spot -}}
  {{- $tolerations = append $tolerations (dict "key" "cloud.google.com/gke-spot" "operator" "Equal" "value" "true" "effect" "NoSchedule") -}}
  {{- end -}}
  {{- $tolerations = concat $tolerations ($extra.tolerations | default list) $v.tolerations }}
  {{- with $tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: learner
      image: {{ include "diloco.learnerImage" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      # A learner that fails says why in its pod status (its last log lines): the
      # coordinator's launcher reports it to `diloco admin add-learners` and `members`.
      terminationMessagePolicy: FallbackToLogsOnError
      args:
        - --log-level
        - {{ $root.Values.logLevel }}
        - learner
        - --device
        - {{ get (dict "tpu" "xla" "gpu" "cuda" "cpu" "cpu") $v.accelerator }}
        - --steps
        - {{ $v.steps | int | quote }}
        - --lr
        - {{ $v.lr | toString | quote }}
        - --inner-optimizer
        - {{ $v.innerOptimizer | quote }}
        - --delta-codec
        - {{ $v.deltaCodec | quote }}
        - --delta-density
        - {{ $v.deltaDensity | toString | quote }}
        - --warmup-steps
        - {{ $v.warmupSteps | int | quote }}
        - --block-size
        - {{ $root.Values.syncer.blockSize | int | quote }}
        {{- /* TaskContext.num_learners: the learners the run is planned for (a task may
        split its data by it); scavenged learners get higher indices. */}}
        - --num-learners
        - {{ max 1 (int $v.replicas) | quote }}
        {{- range $v.extraArgs }}
        - {{ . | quote }}
        {{- end }}
        {{- if .static }}
        - --coordinator
        - {{ include "diloco.coordinatorAddress" $root }}
        - --join-token-file
        - /var/run/diloco/join-token
        - --pool
        - {{ .pool }}
        {{- end }}
        {{- if gt $hosts 1 }}
        - --slice-hosts
        - {{ $hosts | quote }}
        - --slice-index
        - $(SLICE_INDEX)
        - --slice-leader
        - {{ printf "$(JOBSET_NAME)-slice-$(JOB_INDEX)-0.$(JOBSET_NAME).$(POD_NAMESPACE).svc.%s:%d" $root.Values.clusterDomain (int $v.slicePort) }}
        {{- end }}
      env:
        {{- include "diloco.env" (dict "root" $root "service" "diloco-learner" "attributes" (list (printf "diloco.pool=%s" .pool))) | nindent 8 }}
        {{- if eq $v.accelerator "tpu" }}
        - name: PJRT_DEVICE
          value: TPU
        {{- end }}
        {{- if gt $hosts 1 }}
        - name: SLICE_INDEX
          valueFrom:
            fieldRef: {fieldPath: "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
        - name: JOBSET_NAME
          valueFrom:
            fieldRef: {fieldPath: "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"}
        - name: JOB_INDEX
          valueFrom:
            fieldRef: {fieldPath: "metadata.annotations['jobset.sigs.k8s.io/job-index']"}
        {{- end }}
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with (include "diloco.snapshotsEnvFrom" $root) }}
      {{- . | nindent 6 }}
      {{- end }}
      {{- $metricsPort := include "diloco.metricsPort" $root }}
      {{- if or $metricsPort (gt $hosts 1) }}
      ports:
        {{- with $metricsPort }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- if gt $hosts 1 }}
        - name: slice
          containerPort: {{ $v.slicePort }}
          protocol: TCP
        {{- end }}
      {{- end }}
      {{- $resources := deepCopy $v.resources -}}
      {{- $device := dict -}}
      {{- if eq $v.accelerator "tpu" -}}
      {{- $device = dict "google.com/tpu" ((include "diloco.tpuSlice" $root | fromJson).chipsPerHost | int) -}}
      {{- else if eq $v.accelerator "gpu" -}}
      {{- $device = dict "nvidia.com/gpu" ($v.gpu.count | int) -}}
      {{- end -}}
      {{- $_ := set $resources "requests" (merge (deepCopy ($resources.requests | default dict)) $device) -}}
      {{- $_ := set $resources "limits" (merge (deepCopy ($resources.limits | default dict)) $device) }}
      resources:
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        {{- include "diloco.securityContext" . | nindent 8 }}
      volumeMounts:
        - name: join-token
          mountPath: /var/run/diloco
          readOnly: true
        - name: tmp
          mountPath: /tmp
        {{- include "diloco.tlsMount" $root | nindent 8 }}
        {{- if include "diloco.snapshotsVolume" $root }}
        # A learner writes its model, optimizer and data cursor into each snapshot.
        - name: snapshots
          mountPath: /var/lib/diloco/snapshots
        {{- end }}
        {{- with $v.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: join-token
      secret:
        secretName: {{ include "diloco.secretName" $root }}
        defaultMode: 0440
        items:
          - key: join-token
            path: join-token
    {{- include "diloco.tmpVolume" . | nindent 4 }}
    {{- include "diloco.tlsVolume" $root | nindent 4 }}
    {{- if include "diloco.snapshotsVolume" $root }}
    - name: snapshots
      persistentVolumeClaim:
        claimName: {{ include "diloco.snapshotsClaim" $root }}
    {{- end }}
    {{- with $v.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/*
One multi-host TPU slice, one learner, as a JobSet of its own:
(dict "root" $ "name" <JobSet name> "pod" <learnerPod> "metadata" <its metadata, or none in a template>).
Its one replicated job "slice" has one replica: an Indexed Job of one pod per host. A
slice is all or nothing, so a host that fails fails its Job (backoffLimit 0) and the
JobSet restarts. A JobSet restart recreates every Job of the JobSet, which is why each
learner is a JobSet of its own (the static ones as the launched ones): a failed host
restarts its own slice only (learners.backoffLimitPerIndex restarts, then that JobSet
fails), and the other learners go on. The exclusive-topology annotation gives each slice
a node pool of its own (GKE makes a multi-host slice one node pool), as GKE's TPU guides do.
The name is checked as the JobSet webhook would: the longest pod name,
<name>-slice-0-<last host>-<5 random characters>, must be a DNS label.
*/}}
{{- define "diloco.learnerJobSet" -}}
{{- $root := .root -}}
{{- $hosts := include "diloco.learnerHosts" $root | int -}}
{{- $longest := printf "%s-slice-0-%d-abcde" .name (sub $hosts 1) -}}
{{- if gt (len $longest) 63 -}}
{{- fail (printf "learners: the multi-host JobSet's pod names (up to %s) would be %d characters, more than 63: shorten the release name or set fullnameOverride" $longest (len $longest)) -}}
{{- end -}}
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  {{- with .metadata }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  annotations:
    alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool
spec:
  failurePolicy:
    maxRestarts: {{ $root.Values.learners.backoffLimitPerIndex }}
  network:
    enableDNSHostnames: true
  replicatedJobs:
    - name: slice
      replicas: 1
      template:
        spec:
          completionMode: Indexed
          completions: {{ $hosts }}
          parallelism: {{ $hosts }}
          backoffLimit: 0
          template:
            {{- .pod | nindent 12 }}
{{- end -}}

{{/*
What the launcher creates for a pool (a value of the pod-templates ConfigMap): the learner
pod, or on multi-host slices a JobSet of one slice; the launcher names and labels it
(<fullname>-learner-<launch id>: the name checked has a launch id of 8 characters, as
the coordinator makes them). (dict "root" $ "pool" "spot" "spot" true "extra" <pool entry>)
*/}}
{{- define "diloco.learnerTemplate" -}}
{{- $pod := include "diloco.learnerPod" (dict "root" .root "pool" .pool "spot" .spot "static" false "extra" .extra) -}}
{{- if eq (include "diloco.learnerHosts" .root) "1" -}}
{{- $pod -}}
{{- else -}}
{{- include "diloco.learnerJobSet" (dict "root" .root "name" (printf "%s-learner-00000000" (include "diloco.fullname" .root)) "pod" $pod) -}}
{{- end -}}
{{- end -}}

{{- define "diloco.scavengingPoolNames" -}}
{{- $names := list -}}
{{- range .Values.scavenging.pools -}}
{{- if has .name $names -}}
{{- fail (printf "scavenging.pools: pool %q is listed twice" .name) -}}
{{- end -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{/* The coordinator's --pools: the scavenging pools first (the first is where
add-learners launches by default), then the learners' own pool. */}}
{{- define "diloco.pools" -}}
{{- $names := list -}}
{{- if .Values.scavenging.enabled -}}
{{- $names = include "diloco.scavengingPoolNames" . | fromJsonArray -}}
{{- end -}}
{{- if not (has .Values.learners.pool $names) -}}
{{- $names = append $names .Values.learners.pool -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{/* The TLS Secret's mount (a volumeMounts item) and volume (a volumes item). */}}
{{- define "diloco.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /var/run/diloco-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "diloco.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "diloco.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* The port kubelet's gRPC probes use: the plaintext health port under TLS. */}}
{{- define "diloco.probePort" -}}
{{- if .root.Values.tls.enabled }}{{ .root.Values.tls.healthPort }}{{ else }}{{ .port }}{{ end -}}
{{- end -}}

{{/* Where snapshots go: the object-storage URL, or the claim's mount path. */}}
{{- define "diloco.snapshotDir" -}}
{{- .Values.snapshots.url | default "/var/lib/diloco/snapshots" -}}
{{- end -}}

{{/* "true" when snapshots live on the ReadWriteMany claim (enabled, no url). */}}
{{- define "diloco.snapshotsVolume" -}}
{{- if and .Values.snapshots.enabled (not .Values.snapshots.url) }}true{{ end -}}
{{- end -}}

{{/* envFrom of every process that touches snapshots: the object store's credentials. */}}
{{- define "diloco.snapshotsEnvFrom" -}}
{{- if and .Values.snapshots.enabled .Values.snapshots.url .Values.snapshots.credentialsSecret -}}
envFrom:
  - secretRef:
      name: {{ .Values.snapshots.credentialsSecret }}
{{- end -}}
{{- end -}}

{{- define "diloco.snapshotsClaim" -}}
{{- .Values.snapshots.existingClaim | default (printf "%s-snapshots" (include "diloco.fullname" .)) -}}
{{- end -}}

{{/* NetworkPolicy peers: (dict "root" $ "components" (list "learner")) */}}
{{- define "diloco.peers" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: diloco
      app.kubernetes.io/instance: {{ .root.Release.Name }}
    matchExpressions:
      - key: app.kubernetes.io/component
        operator: In
        values: {{ toJson .components }}
{{- end -}}
{{/* The pods of the release's multi-host slices (the JobSet controller labels them). */}}
{{- define "diloco.sliceHostSelector" -}}
matchLabels:
  {{- include "diloco.selectorLabels" (dict "root" . "component" "learner") | nindent 2 }}
matchExpressions:
  - key: jobset.sigs.k8s.io/jobset-name
    operator: Exists
{{- end -}}
{{- define "diloco.metricsIngress" -}}
{{- if .Values.metrics.enabled -}}
- from:
    {{- toYaml .Values.metrics.allowFrom | nindent 4 }}
  ports:
    - port: metrics
      protocol: TCP
{{- end -}}
{{- end -}}
