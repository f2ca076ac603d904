"""Using a trained run in one process: loading it (trained_run.py) and sampling text from it (sampling.py)."""
