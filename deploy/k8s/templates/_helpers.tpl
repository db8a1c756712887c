{{/* Names as in Triton's deploy/k8s-onprem chart: the release name, with the chart's
name added unless the release already holds it, at most 63 characters (DNS labels). */}}
{{- define "tritonspec.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* One component's name: (list $ "triton") -> "<fullname>-triton". */}}
{{- define "tritonspec.name" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "tritonspec.fullname" $root | trunc 52 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{/* Labels that select one component's pods: (list $ "triton"). */}}
{{- define "tritonspec.selector" -}}
app.kubernetes.io/name: {{ (index . 0).Chart.Name }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "tritonspec.labels" -}}
{{ include "tritonspec.selector" . }}
app.kubernetes.io/version: {{ (index . 0).Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ (index . 0).Release.Service }}
helm.sh/chart: {{ printf "%s-%s" (index . 0).Chart.Name (index . 0).Chart.Version }}
{{- end -}}

{{/* requests == limits (a Guaranteed pod): {cpu, memory} and, for Triton, GPUs. */}}
{{- define "tritonspec.resources" -}}
{{- $r := dict "cpu" .cpu "memory" .memory -}}
{{- if .gpus }}{{ $_ := set $r "nvidia.com/gpu" .gpus }}{{ end -}}
requests: {{- toYaml $r | nindent 2 }}
limits: {{- toYaml $r | nindent 2 }}
{{- end -}}

{{- define "tritonspec.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "tritonspec.modelCacheClaim" -}}
{{- .Values.modelCache.existingClaim | default (include "tritonspec.name" (list . "model-cache")) -}}
{{- end -}}
