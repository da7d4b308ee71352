"""What a person reads: the profile, search and sweep summaries (and where their time went), a policy shown, the
figures. Imports _decide, _measure and _core.

Private: every module here is a stage of autoprec.tune; docs/architecture.md draws which may import which."""
