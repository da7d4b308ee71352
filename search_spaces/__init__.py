"""Search-space YAML files shipped with autoprec (installed as the package autoprec.search_spaces)."""
