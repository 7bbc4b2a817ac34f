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
     plus annotations and labels of its own: (list . "component"),
     (list . "component" (dict annotations...)) or (list . "component" (dict ...) (dict labels...)). */}}
{{- define "kvmesh.podMetadata" -}}
{{- $root := index . 0 -}}
{{- $own := dict -}}
{{- if gt (len .) 2 }}{{ $own = index . 2 }}{{ end -}}
{{- $annotations := merge (deepCopy $own) (deepCopy ($root.Values.podAnnotations | default dict)) -}}
labels:
  {{- include "kvmesh.labels" $root | nindent 2 }}
  app.kubernetes.io/component: {{ index . 1 }}
  {{- if gt (len .) 3 }}
  {{- toYaml (index . 3) | nindent 2 }}
  {{- end }}
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

{{/* repository:tag, or repository@digest when a digest pins it: (dict "repository" ... "tag" ... "digest" ...). */}}
{{- define "kvmesh.imageRef" -}}
{{- if .digest -}}
{{ .repository }}@{{ .digest }}
{{- else -}}
{{ .repository }}:{{ .tag }}
{{- end -}}
{{- end -}}

{{- define "kvmesh.image" -}}
{{ include "kvmesh.imageRef" (dict "repository" .Values.image.repository "tag" (.Values.image.tag | default .Chart.AppVersion) "digest" .Values.image.digest) }}
{{- end -}}

{{/* The image a Ray worker group runs: the vLLM variant where its model's engine is vllm. */}}
{{- define "kvmesh.workerImage" -}}
{{- $root := index . 0 -}}
{{- if eq (index . 1).engine.kind "vllm" -}}
{{- $i := $root.Values.image -}}
{{ include "kvmesh.imageRef" (dict "repository" $i.repository "tag" ($i.vllm.tag | default (printf "%s-vllm" ($i.tag | default $root.Chart.AppVersion))) "digest" $i.vllm.digest) }}
{{- else -}}
{{ include "kvmesh.image" $root }}
{{- end -}}
{{- end -}}

{{- define "kvmesh.valkeyImage" -}}
{{ include "kvmesh.imageRef" .Values.redis.bundled.image }}
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

{{/* Secrets, all mounted as files (Secret volumes), never in env, args or a command line.
     Each is the user's (existingSecret) or one the hook Job makes once (secrets-job.yaml). */}}

{{/* The Secret holding the index users' passwords (keys admin, router, replica), or "" (an
     external Redis without credentials). */}}
{{- define "kvmesh.redisSecret" -}}
{{- if .Values.redis.bundled.enabled -}}
{{ .Values.redis.bundled.auth.existingSecret | default (printf "%s-redis-auth" (include "kvmesh.fullname" .)) }}
{{- else -}}
{{ .Values.redis.external.existingSecret }}
{{- end -}}
{{- end -}}

{{/* The Secret holding a part's index password, or "": (list . "router"|"controller"|"ray").
     The Ray pods of the bundled Valkey get none: the controller, its admin, issues each replica
     a user of its own with a fresh password when it starts it, so no pod holds a password
     that could register as, or move, any replica. */}}
{{- define "kvmesh.redisSecretOf" -}}
{{- $root := index . 0 -}}
{{- if not (and (eq (index . 1) "ray") $root.Values.redis.bundled.enabled) -}}
{{ include "kvmesh.redisSecret" $root }}
{{- end -}}
{{- end -}}

{{/* The index role of a part: the controller loads the index functions (admin), the router
     pods are routers, the Ray pods host the replicas. */}}
{{- define "kvmesh.redisRole" -}}
{{- get (dict "router" "router" "controller" "admin" "ray" "replica") . -}}
{{- end -}}

{{/* The ACL user of a role: (list . role). The bundled Valkey's users are kvmesh-<role>. */}}
{{- define "kvmesh.redisUser" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- if $root.Values.redis.bundled.enabled -}}
kvmesh-{{ $role }}
{{- else -}}
{{ get $root.Values.redis.external.usernames $role }}
{{- end -}}
{{- end -}}

{{- define "kvmesh.replicaTokenSecret" -}}
{{ .Values.security.replicaAuth.existingSecret | default (printf "%s-replica-token" (include "kvmesh.fullname" .)) }}
{{- end -}}

{{/* The Ray token (RAY_AUTH_MODE=token), on every Ray pod and every Ray client (the controller). */}}
{{- define "kvmesh.rayAuthSecret" -}}
{{ .Values.ray.auth.existingSecret | default (printf "%s-ray-auth" (include "kvmesh.fullname" .)) }}
{{- end -}}

{{/* Where each secret is mounted: one folder per Secret volume. */}}
{{- define "kvmesh.replicaTokenFile" -}}/etc/kvmesh/replica-token/token{{- end -}}
{{- define "kvmesh.apiKeyFile" -}}/etc/kvmesh/api-key/token{{- end -}}
{{- define "kvmesh.redisPasswordFile" -}}/etc/kvmesh/redis/password{{- end -}}
{{- define "kvmesh.rayTokenFile" -}}/etc/kvmesh/ray/auth_token{{- end -}}

{{/* The Secrets the hook Job makes (NAME=KEY,KEY ...): those the user does not give. */}}
{{- define "kvmesh.generatedSecrets" -}}
{{- $fullname := include "kvmesh.fullname" . -}}
{{- $out := list -}}
{{- if and .Values.ray.auth.enabled (not .Values.ray.auth.existingSecret) -}}
{{- $out = append $out (printf "%s-ray-auth=auth_token" $fullname) -}}
{{- end -}}
{{- if not .Values.security.replicaAuth.existingSecret -}}
{{- $out = append $out (printf "%s-replica-token=%s" $fullname .Values.security.replicaAuth.tokenKey) -}}
{{- end -}}
{{- if and .Values.redis.bundled.enabled (not .Values.redis.bundled.auth.existingSecret) -}}
{{- $out = append $out (printf "%s-redis-auth=admin,router,replica" $fullname) -}}
{{- end -}}
{{- join " " $out -}}
{{- end -}}

{{/* Environment of every kvmesh process: the shared ConfigMap, the settings of one part for
     that part's pods alone, and the paths (never the values) of its secrets. Pass
     (list . "router"|"controller"|"ray"). */}}
{{- define "kvmesh.env" -}}
{{- $root := index . 0 -}}
{{- $who := index . 1 -}}
envFrom:
  - configMapRef:
      name: {{ include "kvmesh.configmap" $root }}
{{- $redis := include "kvmesh.redisSecretOf" (list $root $who) }}
{{- $tls := $root.Values.security.tls }}
{{- $router := eq $who "router" }}
{{- $ray := and $root.Values.ray.auth.enabled (ne $who "router") }}
{{- if or $redis $tls.enabled $router $ray $root.Values.extraEnv }}
env:
  {{- with $root.Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- if $ray }}
  {{- include "kvmesh.rayAuthEnv" $root | nindent 2 }}
  {{- end }}
  {{- if $router }}
  - {name: KVMESH_POLICY, value: {{ $root.Values.router.policy | quote }}}
  - {name: KVMESH_MIGRATION_LIMIT, value: {{ $root.Values.router.migrationLimit | quote }}}
  {{- with $root.Values.router.flow }}
  - {name: KVMESH_FLOW_CONTROL, value: {{ .control | quote }}}
  - {name: KVMESH_PRIORITY_BANDS, value: {{ .bands | quote }}}
  - {name: KVMESH_DEFAULT_BAND, value: {{ .defaultBand | quote }}}
  - {name: KVMESH_TENANTS, value: {{ .tenants | quote }}}
  - {name: KVMESH_TENANT_HEADER, value: {{ .tenantHeader | quote }}}
  - {name: KVMESH_PRIORITY_HEADER, value: {{ .priorityHeader | quote }}}
  - {name: KVMESH_MAX_QUEUE_DELAY, value: {{ .maxQueueDelaySeconds | quote }}}
  {{- end }}
  {{- end }}
  {{- if $redis }}
  - {name: KVMESH_REDIS_USERNAME, value: {{ include "kvmesh.redisUser" (list $root (include "kvmesh.redisRole" $who)) | quote }}}
  - {name: KVMESH_REDIS_PASSWORD_FILE, value: {{ include "kvmesh.redisPasswordFile" $root }}}
  {{- end }}
  {{- if $tls.enabled }}
  - {name: KVMESH_TLS_CERT, value: /etc/kvmesh/tls/tls.crt}
  - {name: KVMESH_TLS_KEY, value: /etc/kvmesh/tls/tls.key}
  - {name: KVMESH_TLS_CA, value: /etc/kvmesh/tls/ca.crt}
  - {name: KVMESH_TLS_SERVER_NAME, value: {{ $tls.serverName | quote }}}
  {{- /* the router authenticates clients by token; replicas require the router's certificate */}}
  - {name: KVMESH_TLS_CLIENT_AUTH, value: {{ ternary "false" (ternary "true" "false" $tls.clientAuth) (eq $who "router") | quote }}}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Ray token authentication, by file (RAY_AUTH_TOKEN_PATH): the token is never in env. */}}
{{- define "kvmesh.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled }}
- {name: RAY_AUTH_MODE, value: token}
- {name: RAY_AUTH_TOKEN_PATH, value: {{ include "kvmesh.rayTokenFile" . }}}
{{- end }}
{{- end -}}

{{/* The Secret volumes of a part and where its kvmesh container mounts them: each pod gets
     only what its process reads (the router no Ray token, each part only its own index
     password, via items). (list . "router"|"controller"|"ray"). */}}
{{- define "kvmesh.secretMounts" -}}
{{- $root := index . 0 -}}
{{- $who := index . 1 -}}
{{- if $root.Values.security.tls.enabled }}
- {name: tls, mountPath: /etc/kvmesh/tls, readOnly: true}
{{- end }}
- {name: replica-token, mountPath: {{ dir (include "kvmesh.replicaTokenFile" $root) }}, readOnly: true}
{{- if and (eq $who "router") $root.Values.security.auth.existingSecret }}
- {name: api-key, mountPath: {{ dir (include "kvmesh.apiKeyFile" $root) }}, readOnly: true}
{{- end }}
{{- if include "kvmesh.redisSecretOf" (list $root $who) }}
- {name: redis-password, mountPath: {{ dir (include "kvmesh.redisPasswordFile" $root) }}, readOnly: true}
{{- end }}
{{- if and $root.Values.ray.auth.enabled (ne $who "router") }}
- {name: ray-auth, mountPath: {{ dir (include "kvmesh.rayTokenFile" $root) }}, readOnly: true}
{{- end }}
{{- end -}}

{{- define "kvmesh.secretVolumes" -}}
{{- $root := index . 0 -}}
{{- $who := index . 1 -}}
{{- if $root.Values.security.tls.enabled }}
- name: tls
  secret:
    secretName: {{ $root.Values.security.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
- name: replica-token
  secret:
    secretName: {{ include "kvmesh.replicaTokenSecret" $root }}
    defaultMode: 0440
    items: [{key: {{ $root.Values.security.replicaAuth.tokenKey }}, path: {{ base (include "kvmesh.replicaTokenFile" $root) }}}]
{{- if and (eq $who "router") $root.Values.security.auth.existingSecret }}
- name: api-key
  secret:
    secretName: {{ $root.Values.security.auth.existingSecret }}
    defaultMode: 0440
    items: [{key: {{ $root.Values.security.auth.tokenKey }}, path: {{ base (include "kvmesh.apiKeyFile" $root) }}}]
{{- end }}
{{- with include "kvmesh.redisSecretOf" (list $root $who) }}
- name: redis-password
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items: [{key: {{ include "kvmesh.redisRole" $who }}, path: {{ base (include "kvmesh.redisPasswordFile" $root) }}}]
{{- end }}
{{- if and $root.Values.ray.auth.enabled (ne $who "router") }}
- name: ray-auth
  secret:
    secretName: {{ include "kvmesh.rayAuthSecret" $root }}
    defaultMode: 0440
    items: [{key: auth_token, path: {{ base (include "kvmesh.rayTokenFile" $root) }}}]
{{- end }}
{{- end -}}

{{/* (list base over): a copy of base with every key over gives set to over's value, false, 0
     and "" included (Helm's merge takes those for unset, so a model's `enforceEager: false`
     could not undo a shared true). One level: the settings it lays over are flat. */}}
{{- define "kvmesh.over" -}}
{{- $out := deepCopy (index . 0 | default dict) -}}
{{- range $key, $value := index . 1 | default dict }}{{ $_ := set $out $key $value }}{{ end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The models this release serves, every setting resolved, as a YAML list (read it with
     fromYamlArray): each entry of `models` over `model` and `controller`, or the one `model`.
     Keys: name ("" for the one model), id, path, servedModelName, blockSize, maxModelLen,
     generationConfig, repo, revision, replicas, engine, resource (the Ray resource its
     replicas take, "" for the one model), workers (over ray.workerGroups[0]). */}}
{{- define "kvmesh.models" -}}
{{- $v := .Values -}}
{{- $out := list -}}
{{- range $v.models | default (list (dict "name" "" "id" $v.model.id "path" $v.model.path "servedModelName" $v.model.servedModelName "download" $v.model.download)) -}}
{{- $download := .download | default dict -}}
{{- $out = append $out (dict
    "name" .name
    "id" .id
    "path" (.path | default (printf "%s/%s" $v.model.cache.mountPath (replace "/" "--" .id)))
    "servedModelName" (.servedModelName | default "")
    "blockSize" (.blockSize | default $v.model.blockSize)
    "maxModelLen" (ternary .maxModelLen $v.model.maxModelLen (hasKey . "maxModelLen"))
    "generationConfig" (.generationConfig | default $v.model.generationConfig)
    "repo" ($download.repo | default .id)
    "revision" ($download.revision | default "")
    "replicas" (.replicas | default $v.controller.replicas)
    "engine" (include "kvmesh.over" (list $v.controller.engine .engine) | fromYaml)
    "resource" (ternary (printf "kvmesh-model-%s" .name) "" (ne .name ""))
    "workers" (.workers | default dict)) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The Ray worker groups, each with its `model` (YAML list): one per model of `models`
     (ray.workerGroups[0] under its `workers`), else ray.workerGroups as given. */}}
{{- define "kvmesh.workerGroups" -}}
{{- $models := include "kvmesh.models" . | fromYamlArray -}}
{{- $out := list -}}
{{- if .Values.models -}}
{{- $template := index .Values.ray.workerGroups 0 -}}
{{- range $models -}}
{{- $group := include "kvmesh.over" (list $template .workers) | fromYaml -}}
{{- $out = append $out (merge (dict "name" .name "model" .) $group) -}}
{{- end -}}
{{- else -}}
{{- range .Values.ray.workerGroups -}}
{{- $out = append $out (merge (dict "model" (index $models 0)) (deepCopy .)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* One model's `--model DIR,KEY=VALUE...` (kvmesh.models entry): (list model "router") what
     the router and the replicas must agree on; "controller" adds its replicas, engine
     settings and Ray resource. */}}
{{- define "kvmesh.modelSpec" -}}
{{- $m := index . 0 -}}
{{- $parts := list $m.path (printf "model-id=%s" $m.id) (printf "block-size=%v" $m.blockSize) (printf "max-model-len=%v" $m.maxModelLen) (printf "generation-config=%s" $m.generationConfig) -}}
{{- with $m.servedModelName }}{{ $parts = append $parts (printf "served-model-name=%s" .) }}{{ end -}}
{{- if eq (index . 1) "controller" -}}
{{- $e := $m.engine -}}
{{- $parts = concat $parts (list (printf "replicas=%v" $m.replicas) (printf "max-num-seqs=%v" $e.maxNumSeqs) (printf "max-num-batched-tokens=%v" $e.maxNumBatchedTokens) (printf "gpu-memory-utilization=%v" $e.gpuMemoryUtilization) (printf "num-kv-blocks=%v" $e.numKvBlocks)) -}}
{{- if not (kindIs "invalid" $e.hostKvGib) }}{{ $parts = append $parts (printf "host-kv-gib=%v" $e.hostKvGib) }}{{ end -}}
{{- with $e.dtype }}{{ $parts = append $parts (printf "dtype=%s" .) }}{{ end -}}
{{- with $e.attentionBackend }}{{ $parts = append $parts (printf "attention-backend=%s" .) }}{{ end -}}
{{- if $e.enforceEager }}{{ $parts = append $parts "enforce-eager=true" }}{{ end -}}
{{- if ne ($e.asyncScheduling | default "auto") "auto" }}{{ $parts = append $parts (printf "async-scheduling=%v" (eq $e.asyncScheduling "on")) }}{{ end -}}
{{- if eq $e.kind "vllm" }}{{ $parts = append $parts "engine=vllm" }}{{ end -}}
{{- with $e.vllmArgs }}{{ $parts = append $parts (printf "vllm-args=%s" .) }}{{ end -}}
{{- with $m.resource }}{{ $parts = append $parts (printf "ray-resource=%s" .) }}{{ end -}}
{{- end -}}
{{- join "," $parts -}}
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

{{/* The init containers that fetch models at deploy time (never at run time), one per model:
     (list . tokenizerOnly models), models as kvmesh.models gives them. Pods that only
     tokenize (the router) fetch config and tokenizer. */}}
{{- define "kvmesh.downloadModel" -}}
{{- $root := index . 0 -}}
{{- $tokenizerOnly := index . 1 -}}
{{- $d := $root.Values.model.download -}}
{{- if $d.enabled }}
initContainers:
  {{- range index . 2 }}
  - name: {{ ternary (printf "download-%s" .name) "download-model" (ne .name "") }}
    {{- /* a worker's own image (one pull a pod); the router's tokenizers: the plain one */}}
    image: {{ ternary (include "kvmesh.image" $root) (include "kvmesh.workerImage" (list $root .)) $tokenizerOnly }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args:
      - download-model
      - {{ .repo | quote }}
      - {{ .path | quote }}
      {{- with .revision }}
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
      - {name: HF_TOKEN_PATH, value: /etc/kvmesh/hf-token/token}  # a file, never the token in env
      {{- end }}
    resources:
      {{- toYaml $d.resources | nindent 6 }}
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    volumeMounts:
      - {name: model, mountPath: {{ $root.Values.model.cache.mountPath }}}
      - {name: tmp, mountPath: /tmp}
      {{- if $d.tokenSecret.name }}
      - {name: hf-token, mountPath: /etc/kvmesh/hf-token, readOnly: true}
      {{- end }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The hub token's Secret volume, in the pods whose init container downloads. */}}
{{- define "kvmesh.downloadVolumes" -}}
{{- $d := .Values.model.download -}}
{{- if and $d.enabled $d.tokenSecret.name }}
- name: hf-token
  secret:
    secretName: {{ $d.tokenSecret.name }}
    defaultMode: 0440
    items: [{key: {{ $d.tokenSecret.key }}, path: token}]
{{- end }}
{{- end -}}

{{/* An emptyDir for /tmp, bounded: (sizeLimit). */}}
{{- define "kvmesh.tmpVolume" -}}
- name: tmp
  emptyDir: {sizeLimit: {{ . }}}
{{- end -}}

{{/* Stop times. The router: its --drain-timeout bounds its whole stop, so it is what the
     grace period leaves after the preStop sleep and a margin. A Ray worker: its preStop
     (kvmesh drain-replicas) waits for its replicas to drain (--drain-timeout each) plus a
     margin, and its grace period is that plus the time Ray takes to stop. */}}
{{- define "kvmesh.routerDrainTimeout" -}}
{{- sub (sub (int .Values.router.terminationGracePeriodSeconds) (int .Values.router.preStopSleepSeconds)) (int .Values.router.drainMarginSeconds) -}}
{{- end -}}

{{- define "kvmesh.replicaDrainWait" -}}
{{- add (int .Values.replica.drainTimeoutSeconds) (int .Values.ray.drainMarginSeconds) -}}
{{- end -}}

{{- define "kvmesh.rayWorkerGrace" -}}
{{- add (include "kvmesh.replicaDrainWait" . | int) (int .Values.ray.stopMarginSeconds) -}}
{{- end -}}

{{/* Ray's ports as rayStartParams (`ray start` on every node): every one fixed (Ray would
     pick some at random), so that the NetworkPolicy can name them; GCS 6379, dashboard 8265
     and client 10001 are KubeRay's defaults. */}}
{{- define "kvmesh.rayStartPorts" -}}
{{- $p := .Values.ray.ports -}}
object-manager-port: {{ $p.objectManager | quote }}
node-manager-port: {{ $p.nodeManager | quote }}
dashboard-agent-grpc-port: {{ $p.dashboardAgentGrpc | quote }}
dashboard-agent-listen-port: {{ $p.dashboardAgentListen | quote }}
runtime-env-agent-port: {{ $p.runtimeEnvAgent | quote }}
metrics-export-port: {{ $p.metricsExport | quote }}
min-worker-port: {{ $p.minWorker | quote }}
max-worker-port: {{ $p.maxWorker | quote }}
{{- end -}}

{{/* A NetworkPolicy peer: this release's pods of the given components (list . "router" ...). */}}
{{- define "kvmesh.peers" -}}
{{- $root := index . 0 -}}
- podSelector:
    matchExpressions:
      - {key: app.kubernetes.io/name, operator: In, values: [{{ include "kvmesh.name" $root | quote }}]}
      - {key: app.kubernetes.io/instance, operator: In, values: [{{ $root.Release.Name | quote }}]}
      - {key: app.kubernetes.io/component, operator: In, values: [{{ rest . | join ", " }}]}
{{- end -}}
