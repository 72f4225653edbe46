{{/* Chart name, overridable. */}}
{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name; Kubernetes names are limited to 63 characters. */}}
{{- define "kvroute.fullname" -}}
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

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" . }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Where kvroute keeps its saved state, after checking the values that choose it:
  "dir"      state_dir on a volume (emptyDir, or a PersistentVolumeClaim): one replica;
  "valkey"   state_url to the Valkey this chart deploys (valkey.enabled);
  "external" state_url to an existing Valkey/Redis (externalValkey.url or .existingSecret).
kvroute refuses state_dir and state_url together, so exactly one is wired per mode.
*/}}
{{- define "kvroute.stateMode" -}}
{{- $external := or .Values.externalValkey.url .Values.externalValkey.existingSecret -}}
{{- if and .Values.valkey.enabled $external -}}
{{- fail "valkey.enabled and externalValkey.url/existingSecret both name kvroute's shared state: choose one" -}}
{{- end -}}
{{- if and .Values.externalValkey.url .Values.externalValkey.existingSecret -}}
{{- fail "externalValkey: give url (the chart puts it in a Secret) or existingSecret (a Secret of yours holding it), not both" -}}
{{- end -}}
{{- if and .Values.valkey.enabled .Values.externalValkey.caSecret -}}
{{- fail "externalValkey.caSecret is for an external rediss:// server; the chart's Valkey speaks plain redis:// inside the namespace" -}}
{{- end -}}
{{- $shared := or .Values.valkey.enabled $external -}}
{{- if and (gt (int .Values.replicaCount) 1) (not $shared) -}}
{{- fail "replicaCount > 1 needs shared state: set valkey.enabled=true (the chart deploys a Valkey) or externalValkey.url / externalValkey.existingSecret (an existing Valkey/Redis); replicas cannot share a state directory" -}}
{{- end -}}
{{- if and $shared .Values.persistence.enabled -}}
{{- fail "persistence.enabled keeps state_dir on a volume, but with valkey.enabled or externalValkey kvroute saves its state in Valkey (state_dir and state_url exclude each other): set persistence.enabled=false" -}}
{{- end -}}
{{- if .Values.valkey.enabled -}}
valkey
{{- else if $external -}}
external
{{- else -}}
dir
{{- end -}}
{{- end }}

{{/* The chart's Valkey: its name (Deployment and Service) and its pods' labels, which
must not match kvroute's selector. */}}
{{- define "kvroute.valkeyFullname" -}}
{{- printf "%s-valkey" (include "kvroute.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvroute.valkeySelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-valkey" (include "kvroute.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: valkey
{{- end }}

{{- define "kvroute.valkeyLabels" -}}
helm.sh/chart: {{ include "kvroute.chart" . }}
{{ include "kvroute.valkeySelectorLabels" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The Secret holding the chart's Valkey password, and its key. */}}
{{- define "kvroute.valkeySecretName" -}}
{{- .Values.valkey.auth.existingSecret | default (printf "%s-state" (include "kvroute.fullname" .)) }}
{{- end }}

{{- define "kvroute.valkeySecretKey" -}}
{{- if .Values.valkey.auth.existingSecret }}{{ .Values.valkey.auth.existingSecretKey }}{{ else }}valkey-password{{ end }}
{{- end }}

{{/* The Secret and key holding an external Valkey/Redis URL (it may carry a password). */}}
{{- define "kvroute.stateUrlSecretName" -}}
{{- .Values.externalValkey.existingSecret | default (printf "%s-state" (include "kvroute.fullname" .)) }}
{{- end }}

{{- define "kvroute.stateUrlSecretKey" -}}
{{- if .Values.externalValkey.existingSecret }}{{ .Values.externalValkey.existingSecretKey }}{{ else }}state-url{{ end }}
{{- end }}
