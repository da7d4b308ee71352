"""The tuner's data, at the bottom: the alternatives' names, numbers, budgets, typed records, the goal type and
registry, targets, the search space and the configuration. Imports nothing of the tuner above it.

Private: every module here is a stage of autoprec.tune; docs/architecture.md draws which may import which."""
