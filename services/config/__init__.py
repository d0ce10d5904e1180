"""How a job is configured: the schema (job.py), its errors (errors.py), its reference
page (docs.py)."""
