"""Measuring: model.py and the workload, the clocks (a step's, the search's own) and the noise rules, training steps,
the metric, the profile (each layer's numerics and time) and the step-time predictor. Imports _core only.

Private: every module here is a stage of autoprec.tune; docs/architecture.md draws which may import which."""
