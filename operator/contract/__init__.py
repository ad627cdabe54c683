"""The InferenceService contract, one source for the CRD and the operator's validation.

- ``schema``: field types that render to OpenAPI and check values in Python.
- ``rules``: CEL rules from one expression vocabulary, rendered and evaluated.
- ``inference_service`` / ``inference_service_status``: the tables (one row per field).
- ``crd``: the CustomResourceDefinition document rendered from them.
"""
