"""What a program needs around its actors: placement, preflight, warm-up, exit codes, quiet logs."""
