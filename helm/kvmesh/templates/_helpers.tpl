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
{{- if or $secret $tls.enabled $router }}
env:
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
