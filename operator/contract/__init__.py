"""The InferenceService contract, one source for the CRD and the operator's validation.

- ``schema``: field types that render to OpenAPI and check values in Python.
- ``rules``: CEL rules from one expression vocabulary, rendered and evaluated.
- ``inference_service`` / ``inference_service_status``: the tables (one row per field).
- ``crd``: the CustomResourceDefinition document rendered from them.

Not to be confused with ``kvpilot.contract``, what the engine and the planner share (this
package takes the engine's dtype and backend names from it). May import: pyyaml,
``kvpilot.contract``, ``kvpilot.operator.constants`` / ``settings`` and the planner's GPU
catalogue.
"""
