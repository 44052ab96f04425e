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
{{- $config := include "sysdra.config" . | fromYaml -}}
{{- if or .Values.nvidia.mps (and .Values.nvidia.enabled $config.nvml) -}}true{{- else -}}false{{- end -}}
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

{{/* The agent's config file settings (.Values.config) with every key in camelCase, as YAML: a
snake_case (or kebab-case) key replaces the chart's camelCase default of the same setting (the agent
takes one spelling of a setting: two would leave it to the order of the file's keys). The settings
the DaemonSet's flags or the chart's own values set fail the render, naming the value to use: in
config they would be ignored, or contradict the DeviceClasses and RBAC (driverName). */}}
{{- define "sysdra.config" -}}
{{- $chart := dict "root" "hostPaths (the DaemonSet runs --root=/host)" "cluster" "nothing: the DaemonSet runs --cluster=kube"
      "kubeletDir" "kubeletDir" "cdiDir" "cdiDir" "driverName" "driverName"
      "rollingUpdateUid" "nothing: the DaemonSet sets the pod's UID" "statusSocket" "nothing: the probes ask the pod's /tmp/status.sock"
      "nriSocket" "nri.socket (nri.enabled)" "metricsAddress" "metrics.port (metrics.enabled)" -}}
{{- $out := dict -}}
{{- range $camel := list true false -}}
{{- range $key, $value := $.Values.config -}}
{{- $name := $key | camelcase | untitle -}}
{{- if hasKey $chart $name -}}
{{- fail (printf "config.%s: set by the chart, not in config: use %s" $key (get $chart $name)) -}}
{{- end -}}
{{- if eq (eq $key $name) $camel -}}
{{- $_ := set $out $name $value -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}
