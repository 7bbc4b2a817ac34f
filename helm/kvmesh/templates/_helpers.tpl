{{/* Names, labels and the pieces every kvmesh pod shares. */}}

{{- define "kvmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains (include "kvmesh.name" .) .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "kvmesh.name" .) | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvmesh.labels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: include "kvmesh.selector" (list . "router") */}}
{{- define "kvmesh.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvmesh.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* A pod template's metadata: kvmesh's labels and the user's pod labels and annotations,
     plus annotations of its own: (list . "component") or (list . "component" (dict ...)). */}}
{{- define "kvmesh.podMetadata" -}}
{{- $root := index . 0 -}}
{{- $own := dict -}}
{{- if gt (len .) 2 }}{{ $own = index . 2 }}{{ end -}}
{{- $annotations := merge (deepCopy $own) (deepCopy ($root.Values.podAnnotations | default dict)) -}}
labels:
  {{- include "kvmesh.labels" $root | nindent 2 }}
  app.kubernetes.io/component: {{ index . 1 }}
  {{- with $root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "kvmesh.podCommon" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end -}}

{{- define "kvmesh.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvmesh.configmap" -}}{{ include "kvmesh.fullname" . }}-config{{- end -}}

{{/* This release's deployment in the prefix index (--deployment of the router and the
     controller): releases of one model on one Redis never share replicas or entries. */}}
{{- define "kvmesh.deployment" -}}
{{- .Values.model.deployment | default (printf "%s.%s" .Release.Namespace .Release.Name) -}}
{{- end -}}

{{- define "kvmesh.redisHost" -}}{{ include "kvmesh.fullname" . }}-valkey{{- end -}}

{{/* Bytes of a Valkey memory size: "1536mb", "2gb" (binary), "500m", "2g" (decimal), "1048576". */}}
{{- define "kvmesh.valkeyBytes" -}}
{{- $size := lower (toString .) -}}
{{- $digits := regexFind "^[0-9]+" $size -}}
{{- $scale := dict "" 1 "b" 1 "k" 1000 "kb" 1024 "m" 1000000 "mb" 1048576 "g" 1000000000 "gb" 1073741824 -}}
{{- mul (int64 $digits) (get $scale (trimPrefix $digits $size)) -}}
{{- end -}}

{{/* Bytes of a Kubernetes memory quantity ("2Gi", "1.5G", "2048Mi", 2147483648), or "" for a
     form this does not read (an exponent, milli): then the caller checks nothing. */}}
{{- define "kvmesh.quantityBytes" -}}
{{- if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) -}}
{{- float64 . -}}
{{- else -}}
{{- $number := regexFind "^[0-9]+([.][0-9]+)?" (toString .) -}}
{{- $scale := dict "" 1.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 -}}
{{- $unit := trimPrefix $number (toString .) -}}
{{- if and $number (hasKey $scale $unit) -}}
{{- mulf (float64 $number) (get $scale $unit) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvmesh.redisURL" -}}
{{- if .Values.redis.bundled.enabled -}}
redis://{{ include "kvmesh.redisHost" . }}:6379/0
{{- else -}}
{{ .Values.redis.external.url }}
{{- end -}}
{{- end -}}

{{/* The Secret and key holding the Redis password, if any: "name/key" or "". */}}
{{- define "kvmesh.redisSecret" -}}
{{- if and .Values.redis.bundled.enabled .Values.redis.bundled.auth.existingSecret -}}
{{ .Values.redis.bundled.auth.existingSecret }}/{{ .Values.redis.bundled.auth.passwordKey }}
{{- else if and (not .Values.redis.bundled.enabled) .Values.redis.external.existingSecret -}}
{{ .Values.redis.external.existingSecret }}/{{ .Values.redis.external.passwordKey }}
{{- end -}}
{{- end -}}

{{/* Environment of every kvmesh process: the shared ConfigMap, the Redis password and TLS
     files (secrets only ever by reference), and the settings of one part for that part's
     pods alone. Pass (list . "router"|"controller"|"ray"). */}}
{{- define "kvmesh.env" -}}
{{- $root := index . 0 -}}
{{- $who := index . 1 -}}
envFrom:
  - configMapRef:
      name: {{ include "kvmesh.configmap" $root }}
{{- $secret := include "kvmesh.redisSecret" $root }}
{{- $tls := $root.Values.security.tls }}
{{- $auth := $root.Values.security.auth }}
{{- $router := eq $who "router" }}
{{- $ray := and $root.Values.ray.auth.enabled (ne $who "router") }}
{{- if or $secret $tls.enabled $router $ray $root.Values.extraEnv }}
env:
  {{- with $root.Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- if $ray }}
  {{- include "kvmesh.rayAuthEnv" $root | nindent 2 }}
  {{- end }}
  {{- if $router }}
  - {name: KVMESH_POLICY, value: {{ $root.Values.router.policy | quote }}}
  {{- end }}
  {{- if $secret }}
  - name: KVMESH_REDIS_PASSWORD
    valueFrom:
      secretKeyRef:
        name: {{ index (splitList "/" $secret) 0 }}
        key: {{ index (splitList "/" $secret) 1 }}
  {{- end }}
  {{- if $tls.enabled }}
  - {name: KVMESH_TLS_CERT, value: /etc/kvmesh/tls/tls.crt}
  - {name: KVMESH_TLS_KEY, value: /etc/kvmesh/tls/tls.key}
  - {name: KVMESH_TLS_CA, value: /etc/kvmesh/tls/ca.crt}
  - {name: KVMESH_TLS_SERVER_NAME, value: {{ $tls.serverName | quote }}}
  {{- /* the router authenticates clients by token; replicas require the router's certificate */}}
  - {name: KVMESH_TLS_CLIENT_AUTH, value: {{ ternary "false" (ternary "true" "false" $tls.clientAuth) (eq $who "router") | quote }}}
  {{- end }}
  {{- if and $auth.existingSecret $router }}
  - name: KVMESH_AUTH_TOKEN
    valueFrom:
      secretKeyRef:
        name: {{ $auth.existingSecret }}
        key: {{ $auth.tokenKey }}
  {{- end }}
{{- end }}
{{- end -}}

{{- define "kvmesh.tlsMount" -}}
{{- if .Values.security.tls.enabled -}}
- {name: tls, mountPath: /etc/kvmesh/tls, readOnly: true}
{{- end -}}
{{- end -}}

{{- define "kvmesh.tlsVolume" -}}
{{- if .Values.security.tls.enabled -}}
- name: tls
  secret:
    secretName: {{ .Values.security.tls.existingSecret }}
    defaultMode: 0440
{{- end -}}
{{- end -}}

{{/* The model folder: model.path, or <mountPath>/<model.id with "/" as "--">. */}}
{{- define "kvmesh.modelPath" -}}
{{- .Values.model.path | default (printf "%s/%s" .Values.model.cache.mountPath (replace "/" "--" .Values.model.id)) -}}
{{- end -}}

{{/* The Ray workers' model volume: a claim (existing, or created by the chart), else an
     emptyDir each worker downloads into. */}}
{{- define "kvmesh.modelVolume" -}}
{{- if or .Values.model.cache.existingClaim .Values.model.cache.create }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.cache.existingClaim | default (printf "%s-model" (include "kvmesh.fullname" .)) }}
{{- else }}
- name: model
  emptyDir: {sizeLimit: {{ .Values.model.cache.sizeLimit }}}
{{- end -}}
{{- end -}}

{{- define "kvmesh.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.cache.mountPath }}
  readOnly: true
{{- end -}}

{{/* The init container that fetches the model at deploy time (never at run time):
     (list . tokenizerOnly). Pods that only tokenize (the router) fetch config and tokenizer. */}}
{{- define "kvmesh.downloadModel" -}}
{{- $root := index . 0 -}}
{{- $tokenizerOnly := index . 1 -}}
{{- $d := $root.Values.model.download -}}
{{- if $d.enabled }}
initContainers:
  - name: download-model
    image: {{ include "kvmesh.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args:
      - download-model
      - {{ $d.repo | default $root.Values.model.id | quote }}
      - {{ include "kvmesh.modelPath" $root | quote }}
      {{- with $d.revision }}
      - --revision={{ . }}
      {{- end }}
      {{- if $tokenizerOnly }}
      - --tokenizer-only
      {{- end }}
    env:
      - {name: HOME, value: /tmp}
      {{- with $d.endpoint }}
      - {name: HF_ENDPOINT, value: {{ . | quote }}}
      {{- end }}
      {{- if $d.tokenSecret.name }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef: {name: {{ $d.tokenSecret.name }}, key: {{ $d.tokenSecret.key }}}
      {{- end }}
    resources:
      {{- toYaml $d.resources | nindent 6 }}
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    volumeMounts:
      - {name: model, mountPath: {{ $root.Values.model.cache.mountPath }}}
      - {name: tmp, mountPath: /tmp}
{{- end }}
{{- end -}}

{{/* Ray token authentication, on every Ray pod and every Ray client (the controller). */}}
{{- define "kvmesh.rayAuthSecret" -}}
{{ .Values.ray.auth.existingSecret | default (printf "%s-ray-auth" (include "kvmesh.fullname" .)) }}
{{- end -}}

{{- define "kvmesh.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled }}
- {name: RAY_AUTH_MODE, value: token}
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "kvmesh.rayAuthSecret" . }}, key: auth_token}
{{- end }}
{{- end -}}
