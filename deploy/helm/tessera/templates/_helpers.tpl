{{/* Names ---------------------------------------------------------------------------------- */}}
{{- define "tessera.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tessera.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<part>": tessera.part (list . "scheduler") */}}
{{- define "tessera.part" -}}
{{- printf "%s-%s" (include "tessera.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{- define "tessera.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: tessera
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "tessera.labels" -}}
{{ include "tessera.commonLabels" . }}
app.kubernetes.io/name: {{ include "tessera.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selector labels of one component: tessera.selector (list . "controlplane") */}}
{{- define "tessera.selector" -}}
app.kubernetes.io/name: {{ include "tessera.name" (index . 0) }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "tessera.componentLabels" -}}
{{ include "tessera.commonLabels" (index . 0) }}
{{ include "tessera.selector" . }}
{{- end -}}

{{/* Images ---------------------------------------------------------------------------------- */}}
{{/* <registry>/<repository>:<tag>: tessera.imageRef (list . .Values.image) */}}
{{- define "tessera.imageRef" -}}
{{- $root := index . 0 }}{{- $image := index . 1 -}}
{{- $registry := trimSuffix "/" ($root.Values.image.registry | default "") -}}
{{- $name := printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- if $registry }}{{ printf "%s/%s" $registry $name }}{{ else }}{{ $name }}{{ end -}}
{{- end -}}

{{- define "tessera.image" -}}
{{- include "tessera.imageRef" (list . .Values.image) -}}
{{- end -}}

{{- define "tessera.nodepluginImage" -}}
{{- include "tessera.imageRef" (list . .Values.nodeplugin.image) -}}
{{- end -}}

{{/* kube-scheduler of the cluster's own version: vMAJOR.MINOR.PATCH without a vendor suffix
     (v1.33.2-eks-1 -> v1.33.2). */}}
{{- define "tessera.schedulerTag" -}}
{{- if .Values.scheduler.image.tag -}}
{{- .Values.scheduler.image.tag -}}
{{- else -}}
{{- $v := semver .Capabilities.KubeVersion.Version -}}
{{- printf "v%d.%d.%d" $v.Major $v.Minor $v.Patch -}}
{{- end -}}
{{- end -}}

{{/* Service names --------------------------------------------------------------------------- */}}
{{- define "tessera.controlplaneService" -}}{{ include "tessera.fullname" . }}{{- end -}}
{{- define "tessera.webhookService" -}}{{ include "tessera.part" (list . "webhook") }}{{- end -}}
{{- define "tessera.postgresqlService" -}}{{ include "tessera.part" (list . "postgresql") }}{{- end -}}
{{- define "tessera.redisService" -}}{{ include "tessera.part" (list . "redis") }}{{- end -}}

{{/* Secret names ---------------------------------------------------------------------------- */}}
{{- define "tessera.secretName" -}}{{ include "tessera.part" (list . "secrets") }}{{- end -}}
{{- define "tessera.allocationKeySecret" -}}{{ include "tessera.part" (list . "allocation-key") }}{{- end -}}
{{- define "tessera.webhookTLSSecret" -}}{{ include "tessera.part" (list . "webhook-tls") }}{{- end -}}
{{- define "tessera.nodeTokenSecret" -}}
{{- default (include "tessera.part" (list . "node-tokens")) .Values.nodeplugin.auth.tokenSecret -}}
{{- end -}}

{{/* ServiceAccounts -------------------------------------------------------------------------- */}}
{{- define "tessera.sa.controlplane" -}}{{ include "tessera.part" (list . "controlplane") }}{{- end -}}
{{- define "tessera.sa.scheduler" -}}{{ include "tessera.part" (list . "scheduler") }}{{- end -}}
{{- define "tessera.sa.worker" -}}{{ include "tessera.part" (list . "worker") }}{{- end -}}
{{- define "tessera.sa.nodeplugin" -}}{{ include "tessera.part" (list . "nodeplugin") }}{{- end -}}

{{/* Checks that stop a render with a message naming the value and the fix. */}}
{{- define "tessera.validate" -}}
{{- if and (not .Values.postgresql.enabled) (not .Values.externalDatabase.url) (not .Values.externalDatabase.existingSecret) -}}
{{- fail "postgresql.enabled=false needs externalDatabase.url (postgres://user:password@host:5432/db) or externalDatabase.existingSecret" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) (not .Values.externalRedis.url) (not .Values.externalRedis.existingSecret) -}}
{{- fail "redis.enabled=false needs externalRedis.url (redis://:password@host:6379/0) or externalRedis.existingSecret" -}}
{{- end -}}
{{- if not (has .Values.mode (list "extender" "dra")) -}}
{{- fail (printf "mode=%v is not a mode Tessera runs: use mode=extender (the scheduler extender and the device plugin) or mode=dra (Kubernetes DRA: ResourceSlices and DeviceClasses; docs/dra.md)" .Values.mode) -}}
{{- end -}}
{{- $factor := toString .Values.nodeplugin.memoryOversubscription -}}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]{1,2})?$" $factor) -}}
{{- fail (printf "nodeplugin.memoryOversubscription=%v is not a decimal number with at most two decimal places: use \"1\" (off) to \"16\", e.g. \"1.5\"" $factor) -}}
{{- else if or (lt (float64 $factor) 1.0) (gt (float64 $factor) 16.0) -}}
{{- fail (printf "nodeplugin.memoryOversubscription=%v is out of range: use \"1\" (off) to \"16\"; a factor below 1 would shrink the cards" $factor) -}}
{{- end -}}
{{- if and (eq .Values.mode "dra") .Values.cardModes.migResources -}}
{{- fail "mode=dra cannot serve cardModes.migResources=true: NVIDIA's nvidia.com/mig-<profile> resources are served through the webhook and the extender, which DRA mode does not run; ask MIG devices with the DeviceClass mig.gpu.tessera.io instead (docs/dra.md)" -}}
{{- end -}}
{{- if and (eq .Values.mode "dra") (eq .Values.nodeplugin.allocationSource "annotation") -}}
{{- fail "mode=dra cannot serve nodeplugin.allocationSource=annotation: in DRA mode the node plugin prepares ResourceClaims and reads no pod's allocation; leave nodeplugin.allocationSource=controlplane (docs/dra.md)" -}}
{{- end -}}
{{- if and (eq .Values.mode "dra") (ne .Values.nodeplugin.deviceMode "cdi") -}}
{{- fail (printf "mode=dra cannot serve nodeplugin.deviceMode=%v: the kubelet hands a prepared claim's devices to the runtime as CDI IDs only; use nodeplugin.deviceMode=cdi (docs/dra.md)" .Values.nodeplugin.deviceMode) -}}
{{- end -}}
{{- end -}}

{{/* Environment ------------------------------------------------------------------------------ */}}
{{/* DATABASE_URL: the bundled PostgreSQL's URL is put together from its password Secret by the
     kubelet ($(VAR) expansion), so the password exists in one place only. */}}
{{- define "tessera.env.database" -}}
{{- if .Values.postgresql.enabled }}
- name: TESSERA_DB_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ include "tessera.secretName" . }}, key: postgresql-password}}
- name: DATABASE_URL
  value: {{ printf "postgres://%s:$(TESSERA_DB_PASSWORD)@%s:5432/%s" .Values.postgresql.username (include "tessera.postgresqlService" .) .Values.postgresql.database | quote }}
{{- else if .Values.externalDatabase.existingSecret }}
- name: DATABASE_URL
  valueFrom: {secretKeyRef: {name: {{ .Values.externalDatabase.existingSecret }}, key: {{ .Values.externalDatabase.existingSecretKey }}}}
{{- else }}
- name: DATABASE_URL
  valueFrom: {secretKeyRef: {name: {{ include "tessera.secretName" . }}, key: database-url}}
{{- end }}
{{- end -}}

{{- define "tessera.env.redis" -}}
{{- if .Values.redis.enabled }}
- name: TESSERA_REDIS_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ include "tessera.secretName" . }}, key: redis-password}}
- name: REDIS_URL
  value: {{ printf "redis://:$(TESSERA_REDIS_PASSWORD)@%s:6379/0" (include "tessera.redisService" .) | quote }}
{{- else if .Values.externalRedis.existingSecret }}
- name: REDIS_URL
  valueFrom: {secretKeyRef: {name: {{ .Values.externalRedis.existingSecret }}, key: {{ .Values.externalRedis.existingSecretKey }}}}
{{- else }}
- name: REDIS_URL
  valueFrom: {secretKeyRef: {name: {{ include "tessera.secretName" . }}, key: redis-url}}
{{- end }}
{{- end -}}

{{/* What every Tessera Django process gets: production mode, its secret key, the database,
     resource names, scheduler name, and the operator's extraEnv. */}}
{{- define "tessera.env.common" -}}
- {name: TESSERA_ENV, value: production}
- {name: TESSERA_KUBE_MODE, value: incluster}
- {name: TESSERA_MODE, value: {{ .Values.mode | quote }}}
- {name: TESSERA_LOCAL_DIR, value: /var/lib/tessera}
- {name: PYTHONDONTWRITEBYTECODE, value: "1"}
- {name: PYTHONUNBUFFERED, value: "1"}
- name: TESSERA_SECRET_KEY
  valueFrom: {secretKeyRef: {name: {{ include "tessera.secretName" . }}, key: secret-key}}
{{- include "tessera.env.database" . }}
- {name: TESSERA_RESOURCE_GPU, value: {{ .Values.resources.gpu | quote }}}
- {name: TESSERA_RESOURCE_GPUMEM, value: {{ .Values.resources.gpumem | quote }}}
- {name: TESSERA_RESOURCE_GPUMEM_PERCENTAGE, value: {{ .Values.resources.gpumemPercentage | quote }}}
- {name: TESSERA_RESOURCE_GPUCORES, value: {{ .Values.resources.gpucores | quote }}}
- {name: TESSERA_RESOURCE_PRIORITY, value: {{ .Values.resources.priority | quote }}}
- {name: TESSERA_SCHEDULER_NAME, value: {{ .Values.scheduler.name | quote }}}
- {name: TESSERA_ADOPTED_SCHEDULERS, value: {{ join "," .Values.scheduler.adopt | quote }}}
{{- /* Card modes (docs/card-modes.md): new cards' modes, and what pods accept and may ask. */}}
- {name: TESSERA_CARD_MODE_DEFAULTS, value: {{ .Values.cardModes.defaults | default list | toJson | quote }}}
- {name: TESSERA_MIG_RESOURCES, value: {{ ternary "1" "0" .Values.cardModes.migResources | quote }}}
- {name: TESSERA_DEFAULT_VGPU_MODES, value: {{ .Values.cardModes.defaultVgpuModes | quote }}}
{{- if eq .Values.nodeplugin.auth.mode "serviceAccountToken" }}
{{- /* Node plugins log in with their projected token; the control plane reviews it. */}}
- {name: TESSERA_NODE_SERVICE_ACCOUNTS, value: {{ printf "%s:%s" .Release.Namespace (include "tessera.sa.nodeplugin" .) | quote }}}
{{- end }}
{{- range $k, $v := .Values.extraEnv }}
- {name: {{ $k }}, value: {{ $v | toString | quote }}}
{{- end }}
{{- end -}}

{{/* "true" when the webhook writes ResourceClaimTemplates: DRA mode with dra.hamiPods. */}}
{{- define "tessera.draTemplates" -}}
{{- and (eq .Values.mode "dra") .Values.dra.hamiPods -}}
{{- end -}}

{{/* Init container: wait until the revision's migrations Job has run (migrate --check passes). */}}
{{- define "tessera.waitForMigrations" -}}
- name: wait-for-migrations
  image: {{ include "tessera.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  workingDir: {{ .Values.image.workingDir }}
  command:
    - sh
    - -c
    - until python manage.py migrate --check --noinput >/dev/null 2>&1; do echo "waiting for the migrations Job"; sleep 5; done
  env:
    {{- include "tessera.env.common" . | nindent 4 }}
  securityContext:
    {{- include "tessera.containerSecurity" . | nindent 4 }}
  volumeMounts:
    - {name: local, mountPath: /var/lib/tessera}
  resources:
    requests: {cpu: 50m, memory: 128Mi}
{{- end -}}

{{- define "tessera.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/* Exec probe for loopback-only listeners: the kubelet's httpGet probes come from the node's
     network namespace and cannot reach 127.0.0.1 inside the pod. */}}
{{- define "tessera.loopbackProbe" -}}
exec:
  command:
    - python
    - -c
    - "import urllib.request; urllib.request.urlopen('http://127.0.0.1:{{ index . 0 }}{{ index . 1 }}', timeout=4)"
{{- end -}}

{{- define "tessera.env.web" -}}
{{- $fullname := include "tessera.fullname" . -}}
{{ include "tessera.env.common" . }}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
# The Service names, loopback, the pod's IP (probes and Prometheus address pods by IP).
- name: TESSERA_ALLOWED_HOSTS
  value: {{ concat (list "localhost" "127.0.0.1" $fullname (printf "%s.%s.svc" $fullname .Release.Namespace) (include "tessera.webhookService" .) (printf "%s.%s.svc" (include "tessera.webhookService" .) .Release.Namespace) "$(POD_IP)") .Values.controlplane.allowedHosts | join "," | quote }}
{{- end -}}
