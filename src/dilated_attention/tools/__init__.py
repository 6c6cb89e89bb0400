"""The ``dilated-attention`` command line: bench, verify, estimate, and the rank launcher."""
