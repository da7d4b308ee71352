"""Training under a policy with the frameworks people already use: `autoprec.integrations.transformers`
(Hugging Face Trainer) and `autoprec.integrations.lightning` (a Lightning precision plugin). Each imports its
framework when imported itself; `import autoprec` imports neither."""
