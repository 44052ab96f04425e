{{/* The release's objects are named after it: "sysdra" for `helm install sysdra`. */}}
{{- define "sysdra.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sysdra.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sysdra.labels" -}}
{{ include "sysdra.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "sysdra.serviceAccountName" -}}
{{- default (include "sysdra.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "sysdra.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Privileged: the MPS daemons' mounts (nvidia.mps), or NVML's device nodes (nvidia.enabled with config.nvml). */}}
{{- define "sysdra.privileged" -}}
{{- if or .Values.nvidia.mps (and .Values.nvidia.enabled .Values.config.nvml) -}}true{{- else -}}false{{- end -}}
{{- end -}}

{{/* The agent's view of a host directory under --root=/host: "/" is /host itself. */}}
{{- define "sysdra.underRoot" -}}
{{- printf "/host/%s" (trimPrefix "/" .) | trimSuffix "/" -}}
{{- end -}}

{{/* Whether the API server has DRAConsumableCapacity (beta and on since 1.36, alpha before): only
then may a DeviceClass's CEL name device.allowMultipleAllocations; the server refuses it otherwise. */}}
{{- define "sysdra.consumableCapacity" -}}
{{- $v := .Values.deviceClasses.consumableCapacity -}}
{{- if kindIs "bool" $v -}}
{{- $v -}}
{{- else if eq (toString $v) "auto" -}}
{{- semverCompare ">=1.36.0-0" .Capabilities.KubeVersion.Version -}}
{{- else -}}
{{- fail (printf "deviceClasses.consumableCapacity must be auto, true or false, not %q" (toString $v)) -}}
{{- end -}}
{{- end -}}
