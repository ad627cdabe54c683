"""kvpilot's Kubernetes side: the torch-free planner and the InferenceService operator.

Nothing under ``kvpilot.operator`` may import torch: the operator image has none.
"""
