{{/* Names and labels, following the usual `helm create` conventions. */}}

{{- define "rollout-sidecar.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name, cut to 63 characters (the DNS label limit). A release name that
already contains the chart name is used as is.
*/}}
{{- define "rollout-sidecar.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rollout-sidecar.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rollout-sidecar.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rollout-sidecar.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rollout-sidecar.labels" -}}
helm.sh/chart: {{ include "rollout-sidecar.chart" . }}
{{ include "rollout-sidecar.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Pods of the server Deployment (service mode). */}}
{{- define "rollout-sidecar.serverSelectorLabels" -}}
{{ include "rollout-sidecar.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{/* The pods that serve HTTP and host the data-plane store: every server pod, or with
multiHost each group's leader (its workers have neither). */}}
{{- define "rollout-sidecar.servingSelectorLabels" -}}
{{ include "rollout-sidecar.serverSelectorLabels" . }}
{{- if .Values.multiHost.enabled }}
rollout-sidecar/host: leader
{{- end }}
{{- end }}

{{/* Pods of the example Job (sidecar mode): trainer + server. */}}
{{- define "rollout-sidecar.jobSelectorLabels" -}}
{{ include "rollout-sidecar.selectorLabels" . }}
app.kubernetes.io/component: training-job
{{- end }}

{{/* "repository:tag", the tag defaulting to the chart's appVersion. Call with (list image ctx). */}}
{{- define "rollout-sidecar.image" -}}
{{- $image := index . 0 }}
{{- $ctx := index . 1 }}
{{- printf "%s:%s" $image.repository (default $ctx.Chart.AppVersion $image.tag) }}
{{- end }}

{{/* The Secret holding the tokens; empty when none is configured. */}}
{{- define "rollout-sidecar.secretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else if .Values.auth.create }}
{{- printf "%s-tokens" (include "rollout-sidecar.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Cross-field rules JSON Schema cannot state. */}}
{{- define "rollout-sidecar.validate" -}}
{{- if eq (int .Values.server.port) (int .Values.server.dataPlanePort) }}
{{- fail "server.dataPlanePort must differ from server.port: they are two listeners in one pod" }}
{{- end }}
{{- $range := .Values.dataPlane.portRange }}
{{- if gt (int $range.start) (int $range.end) }}
{{- fail (printf "dataPlane.portRange.start (%d) must not exceed dataPlane.portRange.end (%d)" (int $range.start) (int $range.end)) }}
{{- end }}
{{- /* A fixed port inside the ephemeral range could be taken by an ephemeral bind before the
server binds it, and the policy's range rule would open it to every data-plane peer. */}}
{{- range $key := list "port" "dataPlanePort" }}
{{- $port := int (index $.Values.server $key) }}
{{- if and (ge $port (int $range.start)) (le $port (int $range.end)) }}
{{- fail (printf "server.%s (%d) must lie outside dataPlane.portRange (%d-%d): the kernel hands out that range as ephemeral ports" $key $port (int $range.start) (int $range.end)) }}
{{- end }}
{{- end }}
{{- if .Values.multiHost.enabled }}
{{- $master := int .Values.multiHost.masterPort }}
{{- if or (eq $master (int .Values.server.port)) (eq $master (int .Values.server.dataPlanePort)) }}
{{- fail (printf "multiHost.masterPort (%d) must differ from server.port and server.dataPlanePort: the leader listens on all three" $master) }}
{{- end }}
{{- if and (ge $master (int $range.start)) (le $master (int $range.end)) }}
{{- fail (printf "multiHost.masterPort (%d) must lie outside dataPlane.portRange (%d-%d): the kernel hands out that range as ephemeral ports" $master (int $range.start) (int $range.end)) }}
{{- end }}
{{- end }}
{{- if .Values.dataPlane.setSysctl }}
{{- range (default list .Values.podSecurityContext.sysctls) }}
{{- if eq .name "net.ipv4.ip_local_port_range" }}
{{- fail "podSecurityContext.sysctls sets net.ipv4.ip_local_port_range: set dataPlane.portRange instead (or dataPlane.setSysctl: false)" }}
{{- end }}
{{- end }}
{{- end }}
{{- $scale := .Values.autoscaling }}
{{- if and $scale.enabled (gt (int $scale.minReplicas) (int $scale.maxReplicas)) }}
{{- fail (printf "autoscaling.minReplicas (%d) must not exceed autoscaling.maxReplicas (%d)" (int $scale.minReplicas) (int $scale.maxReplicas)) }}
{{- end }}
{{- if ge (int .Values.preStopSleepSeconds) (int .Values.terminationGracePeriodSeconds) }}
{{- fail (printf "preStopSleepSeconds (%d) must be below terminationGracePeriodSeconds (%d): the drain needs the rest" (int .Values.preStopSleepSeconds) (int .Values.terminationGracePeriodSeconds)) }}
{{- end }}
{{- if and .Values.auth.create .Values.auth.apiToken (eq .Values.auth.apiToken .Values.auth.adminToken) }}
{{- fail "auth.adminToken must differ from auth.apiToken: the server refuses to start otherwise" }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by the Deployment and the example Job. */}}
{{- define "rollout-sidecar.podSettings" -}}
terminationGracePeriodSeconds: {{ int .Values.terminationGracePeriodSeconds }}
# Service links would inject variables such as ROLLOUT_SIDECAR_PORT=tcp://... for a Service
# named rollout-sidecar, colliding with the server's own settings.
enableServiceLinks: false
# The server never talks to the Kubernetes API.
automountServiceAccountToken: false
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- $securityContext := deepCopy (default dict .Values.podSecurityContext) }}
{{- with include "rollout-sidecar.sysctls" . | fromYamlArray }}
{{- $_ := set $securityContext "sysctls" (concat (default list $securityContext.sysctls) .) }}
{{- end }}
{{- with $securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "rollout-sidecar.servicePorts" -}}
- name: http
  port: {{ int .Values.server.port }}
  targetPort: http
  protocol: TCP
- name: data-plane
  port: {{ int .Values.server.dataPlanePort }}
  targetPort: data-plane
  protocol: TCP
{{- end }}

{{/*
Labels that mark trainer pods. The default lives here, not in values.yaml, so that setting
networkPolicy.trainerPodLabels replaces it instead of being merged with it.
*/}}
{{- define "rollout-sidecar.trainerPodLabels" -}}
{{- toYaml (default (dict "rollout-sidecar/role" "trainer") .Values.networkPolicy.trainerPodLabels) }}
{{- end }}

{{/*
Pod sysctls, as items for `securityContext.sysctls:`: the kernel's ephemeral port range pinned
to dataPlane.portRange, so the ports gloo/NCCL listen on are ports the NetworkPolicy admits.
Empty with dataPlane.setSysctl false. Public: trainer pods of your own charts use it too.
*/}}
{{- define "rollout-sidecar.sysctls" -}}
{{- if .Values.dataPlane.setSysctl -}}
- name: net.ipv4.ip_local_port_range
  value: {{ printf "%d %d" (int .Values.dataPlane.portRange.start) (int .Values.dataPlane.portRange.end) | quote }}
{{- end }}
{{- end }}

{{/* The server replicas' headless Service: every pod, ready or not. */}}
{{- define "rollout-sidecar.headlessName" -}}
{{- printf "%s-headless" (include "rollout-sidecar.fullname" .) }}
{{- end }}
