{{/* Names, labels and the pieces every kvmesh pod shares. */}}

{{- define "kvmesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvmesh.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: include "kvmesh.selector" (list . "router") */}}
{{- define "kvmesh.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvmesh.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvmesh.configmap" -}}{{ include "kvmesh.fullname" . }}-config{{- end -}}

{{- define "kvmesh.redisHost" -}}{{ include "kvmesh.fullname" . }}-valkey{{- end -}}

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

{{/* Environment of every kvmesh process: the shared ConfigMap plus the Redis password. */}}
{{- define "kvmesh.env" -}}
envFrom:
  - configMapRef:
      name: {{ include "kvmesh.configmap" . }}
{{- $secret := include "kvmesh.redisSecret" . }}
{{- if $secret }}
env:
  - name: KVMESH_REDIS_PASSWORD
    valueFrom:
      secretKeyRef:
        name: {{ index (splitList "/" $secret) 0 }}
        key: {{ index (splitList "/" $secret) 1 }}
{{- end }}
{{- end -}}

{{- define "kvmesh.modelVolume" -}}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.cache.existingClaim | default (printf "%s-model" (include "kvmesh.fullname" .)) }}
    readOnly: true
{{- end -}}

{{- define "kvmesh.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.cache.mountPath }}
  readOnly: true
{{- end -}}
