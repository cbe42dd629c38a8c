"""Command lines that evaluate, compare and look at runs: `python -m for_evaluation.<command>` (or
`python for_evaluation/<command>.py` from the repository). They import only the installed `llm_agent` and `verl`."""
