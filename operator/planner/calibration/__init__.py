"""Calibration of the planner's reserve model against public vLLM start-up logs.

- ``cases``: the logs (``vllm_startup_logs.yaml``) as typed records, each with its source;
- ``replay``: every case through the planner: planned / reported KV capacity, summarised as
  the median absolute error and the worst over-prediction, before and after the margin;
- ``fit``: the measured terms recomputed from the logs' own figures, and the grid fit of
  the two fitted constants and of the safety margin.

``python -m kvpilot.operator.planner.calibration`` prints the replay table and the fit.
Torch-free, like the rest of the planner; may import pyyaml and the planner.
"""
