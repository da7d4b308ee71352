"""Running a search: the study's storage, the trial loop, the output folder, the final re-measure, the policy file's
record and the one pipeline with its two plans (search, sweep). Imports every stage below.

Private: every module here is a stage of autoprec.tune; docs/architecture.md draws which may import which."""
