"""``python -m services.cli``: the ``tally`` command."""

from services.cli import app

app()
