"""Deciding: the alternatives every result is measured beside, the choice's rules, the goals' implementations (speed,
memory, flops) and the trials' records. Imports _measure and _core.

Private: every module here is a stage of autoprec.tune; docs/architecture.md draws which may import which."""
