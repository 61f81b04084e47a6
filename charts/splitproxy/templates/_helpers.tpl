{{/* The chart's name. */}}
{{- define "splitproxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of every object's name. */}}
{{- define "splitproxy.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "splitproxy.brain" -}}{{ include "splitproxy.fullname" . | trunc 57 | trimSuffix "-" }}-brain{{- end -}}
{{- define "splitproxy.actuator" -}}{{ include "splitproxy.fullname" . | trunc 54 | trimSuffix "-" }}-actuator{{- end -}}

{{- define "splitproxy.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "splitproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: splitproxy
{{- end -}}

{{/* Selector labels of one component ("brain" or "actuator"): call with (list . "brain"). */}}
{{- define "splitproxy.selector" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "splitproxy.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* An image reference: call with (list . .Values.image.brain). */}}
{{- define "splitproxy.image" -}}
{{- $ := index . 0 -}}
{{- $image := index . 1 -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default $.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The actuator's health and metrics ports: off kube-proxy's ports when beside it. */}}
{{- define "splitproxy.actuator.healthzPort" -}}
{{- if kindIs "invalid" .Values.actuator.healthzPort -}}
{{- ternary 10256 10266 (eq .Values.kubeProxy.mode "replace") -}}
{{- else -}}
{{- .Values.actuator.healthzPort -}}
{{- end -}}
{{- end -}}
{{- define "splitproxy.actuator.metricsPort" -}}
{{- if kindIs "invalid" .Values.actuator.metricsPort -}}
{{- ternary 10249 10267 (eq .Values.kubeProxy.mode "replace") -}}
{{- else -}}
{{- .Values.actuator.metricsPort -}}
{{- end -}}
{{- end -}}

{{/* The ConfigMap holding the CA bundle of the brain's certificate (`ca.crt`). */}}
{{- define "splitproxy.caConfigMap" -}}
{{- default (printf "%s-ca" (include "splitproxy.brain" .)) .Values.tls.caConfigMapName -}}
{{- end -}}

{{/* The environment that points a component at the API server directly (k8sServiceHost). */}}
{{/*
OpenTelemetry (docs/observability.md), with `tracing.endpoint` set; `resource` is an
OTEL_RESOURCE_ATTRIBUTES value naming the pod or node (variables defined before it expand).
*/}}
{{- define "splitproxy.tracingEnv" -}}
{{- $tracing := .root.Values.tracing -}}
{{- if $tracing.endpoint -}}
# The node's address, for an endpoint on the node: `http://$(HOST_IP):4317`.
- name: HOST_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
- name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
  value: {{ $tracing.endpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $tracing.sampleRatio | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ .resource | quote }}
{{- end -}}
{{- end -}}

{{- define "splitproxy.apiServerEnv" -}}
{{- if .Values.k8sServiceHost }}
# The API server directly: the kubernetes ClusterIP needs a working Service proxy.
- name: KUBERNETES_SERVICE_HOST
  value: {{ .Values.k8sServiceHost | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ .Values.k8sServicePort | quote }}
{{- end }}
{{- end -}}

{{/*
Checks that fail the render with a clear message instead of installing something that cannot
work.
*/}}
{{- define "splitproxy.checks" -}}
{{- $kube := .Capabilities.KubeVersion.Version -}}
{{- if not (semverCompare ">=1.33.0-0" $kube) -}}
{{- fail (printf "splitproxy needs Kubernetes 1.33 or later (ServiceCIDR networking.k8s.io/v1); this cluster is %s" $kube) -}}
{{- end -}}
{{- if eq .Values.kubeProxy.mode "replace" -}}
{{- if not .Values.k8sServiceHost -}}
{{- fail "kubeProxy.mode=replace needs k8sServiceHost (and k8sServicePort): without kube-proxy the kubernetes Service's ClusterIP only works once splitproxy does, so the brain must reach the API server directly" -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.identity.mode "files") (eq .Values.tls.source "brain") -}}
{{- fail "identity.mode=files needs tls.source existingSecret or certManager: the brain trusts that Secret's ca.crt, the CA of the nodes' client certificates (the brain's own CA signs no client certificate)" -}}
{{- end -}}
{{- if and (eq .Values.identity.mode "serviceAccountToken") (ne .Values.tls.source "brain") (not .Values.tls.caConfigMapName) -}}
{{- fail "identity.mode=serviceAccountToken with tls.source existingSecret or certManager needs tls.caConfigMapName: a ConfigMap whose ca.crt is the CA of the brain's certificate (the actuators never mount the brain's Secret)" -}}
{{- end -}}
{{- if and (eq .Values.identity.mode "podCertificate") (ne .Values.tls.source "brain") -}}
{{- fail "identity.mode=podCertificate needs tls.source=brain: the brains sign the nodes' certificates with their own CA" -}}
{{- end -}}
{{- if and (eq .Values.identity.mode "podCertificate") (not (.Capabilities.APIVersions.Has "certificates.k8s.io/v1/PodCertificateRequest")) -}}
{{- fail "identity.mode=podCertificate needs PodCertificateRequest (certificates.k8s.io/v1, Kubernetes 1.37)" -}}
{{- end -}}
{{- if eq .Values.identity.mode "serviceAccountToken" -}}
{{- if not (.Capabilities.APIVersions.Has "authentication.k8s.io/v1") -}}
{{- fail "identity.mode=serviceAccountToken needs the TokenReview API (authentication.k8s.io/v1)" -}}
{{- end -}}
{{- end -}}
{{- if eq (include "splitproxy.actuator.healthzPort" .) (include "splitproxy.actuator.metricsPort" .) -}}
{{- fail "actuator.healthzPort and actuator.metricsPort must differ (the chart declares each as a host port)" -}}
{{- end -}}
{{- if and .Values.monitoring.serviceMonitor.enabled (not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) -}}
{{- fail "monitoring.serviceMonitor.enabled needs the Prometheus Operator's CRDs (monitoring.coreos.com/v1 ServiceMonitor)" -}}
{{- end -}}
{{- if and .Values.monitoring.prometheusRule.enabled (not (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PrometheusRule")) -}}
{{- fail "monitoring.prometheusRule.enabled needs the Prometheus Operator's CRDs (monitoring.coreos.com/v1 PrometheusRule)" -}}
{{- end -}}
{{- if and (eq .Values.tls.source "certManager") (not (.Capabilities.APIVersions.Has "cert-manager.io/v1/Certificate")) -}}
{{- fail "tls.source=certManager needs cert-manager's CRDs (cert-manager.io/v1 Certificate)" -}}
{{- end -}}
{{- end -}}

{{/* host:port, with brackets around an IPv6 host: call with (list HOST PORT). */}}
{{- define "splitproxy.hostPort" -}}
{{- $host := index . 0 -}}
{{- if contains ":" $host -}}
{{- printf "[%s]:%d" $host (int (index . 1)) -}}
{{- else -}}
{{- printf "%s:%d" $host (int (index . 1)) -}}
{{- end -}}
{{- end -}}
