{{/*
The server container and the pod pieces it needs. One definition serves the Deployment
(service mode), the example Job (sidecar mode) and users' own charts.

Public named templates, each rendering YAML list items; call them with this chart's scope
(inside this chart: `.`; from a parent chart: `index .Subcharts "rollout-sidecar"`):
  rollout-sidecar.sidecarContainer  under `initContainers:`: the server as a native sidecar
  rollout-sidecar.volumes           under `volumes:`: shm, cache and (pvc source) the model
  rollout-sidecar.clientEnv         under the trainer's `env:`: URL and token secretKeyRefs
                                    (sidecar mode: localhost; service mode: the dns+ headless URL)
  rollout-sidecar.shmVolumeMount    under the trainer's `volumeMounts:`: the shared /dev/shm
  rollout-sidecar.sysctls           under the pod's `securityContext.sysctls:`: the ephemeral
                                    port range (defined in _helpers.tpl)
*/}}

{{- define "rollout-sidecar.sidecarContainer" -}}
{{ include "rollout-sidecar.serverContainer" (dict "ctx" . "sidecar" true) }}
{{- end }}

{{/*
Call with (dict "ctx" <chart scope> "sidecar" <bool>), plus "host" "leader" or "worker" for a
pod of a multi-host replica (leaderworkerset.yaml): the leader serves as node 0, a worker runs
`serve --headless` (no HTTP, no tokens, no probes) with the same settings.
*/}}
{{- define "rollout-sidecar.serverContainer" -}}
{{- $ctx := .ctx }}
{{- $v := $ctx.Values }}
{{- $s := $v.server }}
{{- $host := default "" .host }}
{{- $worker := eq $host "worker" }}
{{- include "rollout-sidecar.validate" $ctx -}}
- name: rollout-sidecar
  image: {{ include "rollout-sidecar.image" (list $s.image $ctx) | quote }}
  imagePullPolicy: {{ $s.image.pullPolicy }}
  {{- if .sidecar }}
  # Native sidecar: starts before the trainer (once its startup probe passes) and is stopped
  # after the trainer exits, so the Job completes.
  restartPolicy: Always
  {{- end }}
  command: ["rollout-sidecar", "serve"]
  {{- if $host }}
  args:
    {{- include "rollout-sidecar.hostArgs" (dict "multiHost" $v.multiHost "host" $host) | nindent 4 }}
  {{- end }}
  {{- if not $worker }}
  ports:
    - name: http
      containerPort: {{ int $s.port }}
      protocol: TCP
    - name: data-plane
      containerPort: {{ int $s.dataPlanePort }}
      protocol: TCP
  {{- end }}
  env:
    # Probes reach the pod IP, so the server must not bind to loopback only.
    - name: ROLLOUT_SIDECAR_HOST
      value: "0.0.0.0"
    - name: ROLLOUT_SIDECAR_PORT
      value: {{ int $s.port | quote }}
    - name: ROLLOUT_SIDECAR_DATA_PLANE_PORT
      value: {{ int $s.dataPlanePort | quote }}
    - name: ROLLOUT_SIDECAR_DTYPE
      value: {{ $s.dtype | quote }}
    {{- if $s.quantization }}
    - name: ROLLOUT_SIDECAR_QUANTIZATION
      value: {{ $s.quantization | quote }}
    {{- end }}
    {{- if $s.speculativeConfig }}
    - name: ROLLOUT_SIDECAR_SPECULATIVE_CONFIG
      value: {{ $s.speculativeConfig | toJson | quote }}
    {{- end }}
    - name: ROLLOUT_SIDECAR_CACHE_DIR
      value: {{ $v.cache.mountPath | quote }}
    {{- with (include "rollout-sidecar.modelPath" $ctx) }}
    - name: ROLLOUT_SIDECAR_MODEL
      value: {{ . | quote }}
    {{- end }}
    {{- if $s.maxModelLen }}
    - name: ROLLOUT_SIDECAR_MAX_MODEL_LEN
      value: {{ int $s.maxModelLen | quote }}
    {{- end }}
    {{- if $s.gpuMemoryUtilization }}
    - name: ROLLOUT_SIDECAR_GPU_MEMORY_UTILIZATION
      value: {{ $s.gpuMemoryUtilization | quote }}
    {{- end }}
    {{- if $s.kvCacheGib }}
    - name: ROLLOUT_SIDECAR_KV_CACHE_GIB
      value: {{ $s.kvCacheGib | quote }}
    {{- end }}
    {{- if $host }}
    # vLLM's message queues and gloo groups name this host by its pod IP.
    - name: VLLM_HOST_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    {{- with $v.multiHost.socketIfname }}
    - name: GLOO_SOCKET_IFNAME
      value: {{ . | quote }}
    {{- end }}
    {{- end }}
    {{- if and (not .sidecar) (not $worker) $s.catchUpFromPeers }}
    # A replica that (re)starts takes the version its peers serve before it reports ready
    # (docs/replicas.md, "Catching up from a peer"); the headless Service lists every pod.
    - name: ROLLOUT_SIDECAR_PEERS
      value: {{ printf "dns+http://%s:%d" (include "rollout-sidecar.headlessName" $ctx) (int $s.port) | quote }}
    {{- end }}
    - name: ROLLOUT_SIDECAR_REQUIRE_DATA_PLANE_SECRET
      value: {{ $v.dataPlane.requireSecret | quote }}
    - name: ROLLOUT_SIDECAR_REQUIRE_BUCKET_MACS
      value: {{ $v.dataPlane.requireBucketMacs | quote }}
    {{- if not $worker }}
    {{- include "rollout-sidecar.tokenEnv" $ctx | nindent 4 }}
    {{- end }}
    {{- range $name, $value := $s.engineEnv }}
    - name: {{ $name }}
      value: {{ $value | toString | quote }}
    {{- end }}
  {{- include "rollout-sidecar.resources" (dict "server" $s "shm" $v.shm) | nindent 2 }}
  {{- with $s.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if and (not .sidecar) (not $worker) }}
  # A leave (docs/replicas.md): no new work, what it holds finished, a push begun run
  # to its end (POST /drain), and at least preStopSleepSeconds for the Services'
  # endpoints to drop the pod; then SIGTERM finds nothing left to cut.
  lifecycle:
    preStop:
      exec:
        command: ["rollout-sidecar", "drain", "--url", "http://127.0.0.1:{{ int $s.port }}",
                  "--min-s", "{{ int $v.preStopSleepSeconds }}",
                  "--timeout-s", "{{ max 1 (sub (int $v.terminationGracePeriodSeconds) 10) }}"]
  {{- end }}
  {{- if not $worker }}
  startupProbe:
    httpGet:
      path: /health
      port: http
    {{- toYaml $s.probes.startup | nindent 4 }}
  livenessProbe:
    httpGet:
      path: /health
      port: http
    {{- toYaml $s.probes.liveness | nindent 4 }}
  readinessProbe:
    httpGet:
      path: /ready
      port: http
    {{- toYaml $s.probes.readiness | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: rollout-sidecar-shm
      mountPath: /dev/shm
    - name: rollout-sidecar-cache
      mountPath: {{ $v.cache.mountPath }}
    {{- if eq $v.model.source "pvc" }}
    - name: rollout-sidecar-model
      mountPath: {{ $v.model.pvc.mountPath }}
      readOnly: true
    {{- end }}
{{- end }}

{{/*
A multi-host pod's `serve` arguments (vLLM's flags): node 0 serves; a worker is
`--headless` with its node rank from LWS's worker index. LeaderWorkerSet puts
LWS_LEADER_ADDRESS (the leader pod's DNS name) and LWS_WORKER_INDEX first in every
container's env, and Kubernetes expands $(VAR) in args from it. Call with
(dict "multiHost" .Values.multiHost "host" "leader"|"worker").
*/}}
{{- define "rollout-sidecar.hostArgs" -}}
{{- $m := .multiHost -}}
{{- if eq .host "worker" -}}
- --headless
- --node-rank
- $(LWS_WORKER_INDEX)
- --head-gone-s
- {{ $m.headGoneSeconds | toString | quote }}
{{- else -}}
- --node-rank
- "0"
{{- end }}
- --nnodes
- {{ int $m.nnodes | quote }}
- --master-addr
- $(LWS_LEADER_ADDRESS)
- --master-port
- {{ int $m.masterPort | quote }}
{{- end }}

{{/* ROLLOUT_SIDECAR_MODEL; empty for the embedded default model. */}}
{{- define "rollout-sidecar.modelPath" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "image" }}
{{- $m.path }}
{{- else if eq $m.source "pvc" }}
{{- if $m.pvc.subPath }}
{{- printf "%s/%s" (trimSuffix "/" $m.pvc.mountPath) $m.pvc.subPath }}
{{- else }}
{{- $m.pvc.mountPath }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Token env for server and trainer alike, always by secretKeyRef. The API token is optional
(unset leaves /generate open); the admin token is required, so a Secret without it stops the
pod with CreateContainerConfigError instead of running a server that refuses every push.
*/}}
{{- define "rollout-sidecar.tokenEnv" -}}
{{- with (include "rollout-sidecar.secretName" .) -}}
- name: ROLLOUT_SIDECAR_API_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.auth.apiTokenKey }}
      optional: true
- name: ROLLOUT_SIDECAR_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.auth.adminTokenKey }}
{{- end }}
{{- end }}

{{/*
Requests and limits, with the GPU count added to both (extended resources need equal values)
and the /dev/shm volume's size added to the memory given: a memory-backed emptyDir is RAM
charged to the container that writes it, and the server stages a push there (TP >= 2).
Call with (dict "server" .Values.server "shm" .Values.shm).
*/}}
{{- define "rollout-sidecar.resources" -}}
{{- $s := .server }}
{{- $shm := include "rollout-sidecar.quantityBytes" .shm.sizeLimit | float64 }}
{{- $requests := deepCopy (default dict $s.resources.requests) }}
{{- $limits := deepCopy (default dict $s.resources.limits) }}
{{- range $part := list $requests $limits }}
{{- if hasKey $part "memory" }}
{{- $bytes := addf (include "rollout-sidecar.quantityBytes" $part.memory | float64) $shm }}
{{- $_ := set $part "memory" (printf "%dMi" (int64 (ceil (divf $bytes 1048576.0)))) }}
{{- end }}
{{- end }}
{{- if gt (int $s.gpu.count) 0 }}
{{- $_ := set $requests $s.gpu.resourceName (int $s.gpu.count) }}
{{- $_ = set $limits $s.gpu.resourceName (int $s.gpu.count) }}
{{- end -}}
resources:
  {{- with $requests }}
  requests:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $limits }}
  limits:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{- define "rollout-sidecar.volumes" -}}
# RAM-backed, so NCCL/gloo and torch multiprocessing get more than the runtime's 64Mi.
- name: rollout-sidecar-shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
- name: rollout-sidecar-cache
  emptyDir:
    sizeLimit: {{ .Values.cache.sizeLimit }}
{{- if eq .Values.model.source "pvc" }}
- name: rollout-sidecar-model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- end }}
{{- end }}

{{/*
Sidecar mode: the server in the same pod. Service mode: every replica, ready or not, through
the headless Service; `dns+` makes the client and pusher resolve the name to each pod address.
*/}}
{{- define "rollout-sidecar.clientEnv" -}}
- name: ROLLOUT_SIDECAR_URL
  {{- if eq .Values.mode "sidecar" }}
  value: {{ printf "http://localhost:%d" (int .Values.server.port) | quote }}
  {{- else }}
  value: {{ printf "dns+http://%s:%d" (include "rollout-sidecar.headlessName" .) (int .Values.server.port) | quote }}
  {{- end }}
{{ include "rollout-sidecar.tokenEnv" . }}
{{- end }}

{{- define "rollout-sidecar.shmVolumeMount" -}}
- name: rollout-sidecar-shm
  mountPath: /dev/shm
{{- end }}

{{/* A Kubernetes quantity (string or number) in bytes, printed as a float: "2Gi" -> 2147483648. */}}
{{- define "rollout-sidecar.quantityBytes" -}}
{{- $q := toString . }}
{{- $unit := regexFind "[a-zA-Z]+$" $q }}
{{- $scale := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- mulf (float64 (trimSuffix $unit $q)) (get $scale $unit) }}
{{- end }}
