{{/* The objects' name: fixed, as a node's service proxy is one per cluster. */}}
{{- define "nftproxy.name" -}}
{{- default "nftproxy" .Values.nameOverride -}}
{{- end -}}

{{- define "nftproxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nftproxy.name" . }}
{{- end -}}

{{/* Labels of every object: the selector's and commonLabels. */}}
{{- define "nftproxy.labels" -}}
{{ include "nftproxy.selectorLabels" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "nftproxy.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}:{{ $tag }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{/* IP:PORT, an IPv6 address in brackets. */}}
{{- define "nftproxy.hostPort" -}}
{{- if contains ":" .address -}}
[{{ .address }}]:{{ .port }}
{{- else -}}
{{ .address }}:{{ .port }}
{{- end -}}
{{- end -}}

{{- define "nftproxy.metricsLoopback" -}}
{{- $a := .Values.metrics.bindAddress -}}
{{- if or (hasPrefix "127." $a) (eq $a "::1") (eq $a "localhost") -}}true{{- end -}}
{{- end -}}
