{{/* Names, labels and the values derived from several keys. */}}

{{- define "kvpilot.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: the release name, suffixed with the chart name unless it has it. */}}
{{- define "kvpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selects the operator pods. The engine pods the operator builds carry
     component=engine and the InferenceService's name as instance, so they never match. */}}
{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvpilot.labels" -}}
{{ include "kvpilot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpilot.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvpilot.operatorImage" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The engine image: what the operator puts into every engine Deployment. */}}
{{- define "kvpilot.engineImage" -}}
{{- printf "%s:%s" .Values.engine.image.repository (default .Chart.AppVersion .Values.engine.image.tag) -}}
{{- end -}}

{{- define "kvpilot.peeringName" -}}
{{- default (include "kvpilot.fullname" .) .Values.peering.name -}}
{{- end -}}

{{/* The namespaces the operator watches, as a JSON list (read it with fromJsonArray):
     watchNamespaces, else the release's own namespace with rbac.scope=namespaces, else
     none (the whole cluster). */}}
{{- define "kvpilot.watchNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- toJson .Values.watchNamespaces -}}
{{- else if eq .Values.rbac.scope "namespaces" -}}
{{- list .Release.Namespace | toJson -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/* kopf's peering resource: cluster-wide operators share a ClusterKopfPeering,
     namespaced ones a KopfPeering in each watched namespace. */}}
{{- define "kvpilot.peeringResource" -}}
{{- if empty (fromJsonArray (include "kvpilot.watchNamespaces" .)) -}}clusterkopfpeerings{{- else -}}kopfpeerings{{- end -}}
{{- end -}}

{{/* Fails the render on combinations the schema cannot express. */}}
{{- define "kvpilot.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.peering.enabled) -}}
{{- fail "replicaCount > 1 needs peering.enabled=true: without peering every replica would reconcile every InferenceService" -}}
{{- end -}}
{{- end -}}

{{/* Whether the Prometheus-operator API is served (helm template: --api-versions monitoring.coreos.com/v1). */}}
{{- define "kvpilot.monitoringApi" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{/* A label map as the operator's KVPILOT_* variables take it: "k=v,k2=v2" (sorted by key). */}}
{{- define "kvpilot.labelList" -}}
{{- $pairs := list -}}
{{- range $k, $v := . -}}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}

{{/* A glob (only * and ? are special) as an anchored RE2 expression: the same rule as
     kvpilot.operator.security.glob_regex, so the admission policy and the operator agree. */}}
{{- define "kvpilot.globRegex" -}}
{{- printf "^%s$" (regexQuoteMeta . | replace "\\*" ".*" | replace "\\?" ".") -}}
{{- end -}}

{{/* A list of globs as a CEL list literal of regular expressions (JSON's string escapes are CEL's). */}}
{{- define "kvpilot.globRegexList" -}}
{{- $out := list -}}
{{- range . -}}
{{- $out = append $out (include "kvpilot.globRegex" .) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
