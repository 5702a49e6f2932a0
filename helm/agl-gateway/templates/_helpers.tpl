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

{{/* Service name of the bundled bitnami Redis (standalone master), as that chart names it. */}}
{{- define "agl-gateway.redisHost" -}}
{{- if contains "redis" .Release.Name }}
{{- printf "%s-master" .Release.Name }}
{{- else }}
{{- printf "%s-redis-master" .Release.Name }}
{{- end }}
{{- end }}
