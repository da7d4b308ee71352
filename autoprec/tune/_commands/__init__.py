"""The command line's verbs (autoprec/tune/_cli.py lists them): one module a verb, or two that share their options
(search and sweep; export and verify), each with its own arguments (_shared.Verb); _shared.py holds what every verb
shares, and what the verbs that load a model.py share."""
