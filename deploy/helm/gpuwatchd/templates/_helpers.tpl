{{/* Labels of every object: the kustomization's app.kubernetes.io/name plus Helm's own. */}}
{{- define "gpuwatchd.labels" -}}
app.kubernetes.io/name: gpuwatchd
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* An object of deploy/kubernetes (files/NAME.yaml) in the release's namespace, with the
labels above added to its own. */}}
{{- define "gpuwatchd.object" -}}
{{- $obj := .root.Files.Get (printf "files/%s.yaml" .name) | fromYaml -}}
{{- $_ := set $obj.metadata "namespace" .root.Release.Namespace -}}
{{- $labels := merge (dict) (.extra | default dict) (include "gpuwatchd.labels" .root | fromYaml) $obj.metadata.labels -}}
{{- $_ := set $obj.metadata "labels" $labels -}}
{{- toJson $obj -}}
{{- end -}}
