"""`make demo`: one command that shows the pool at work (see run.py)."""
