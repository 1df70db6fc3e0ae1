"""Rendering (pure): a validated TrainingJob + OperatorSettings -> the ConfigMap and JobSet the operator creates.

Entry point: :func:`wanloom_operator.render.jobset.render_trainingjob`. Imports only the API, the settings, Jinja2
and PyYAML: no kopf, no Kubernetes client.
"""
