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
{{- with .Values.podSecurityContext }}
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
