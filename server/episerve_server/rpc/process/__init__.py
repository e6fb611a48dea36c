"""A server's life: start-up, serving, drain, and the processes of ``--workers N``."""
