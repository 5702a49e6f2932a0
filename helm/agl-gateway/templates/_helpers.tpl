{{/* Names and labels. */}}
{{- define "agl-gateway.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "agl-gateway.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "agl-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agl-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "agl-gateway.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "agl-gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: agl
{{- end }}

{{/* The Secret holding AGL_KEY. */}}
{{- define "agl-gateway.keySecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-key" (include "agl-gateway.fullname" .)) }}
{{- end }}

{{/* Service (and StatefulSet) name of the chart's own Redis (redis.enabled=true). */}}
{{- define "agl-gateway.redisHost" -}}
{{- printf "%s-redis" (include "agl-gateway.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The gateway pods (the Service, the PodDisruptionBudget and the Deployment select these, not Redis's). */}}
{{- define "agl-gateway.gatewaySelectorLabels" -}}
{{ include "agl-gateway.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}
