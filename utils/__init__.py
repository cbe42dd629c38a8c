"""Command lines that prepare a run: `python -m utils.<command>` from the repository root (tiny model, prompt data,
supervised warm start, profiles, iterations, validation summary)."""
