"""``tally train-rm``: a Bradley–Terry reward model trained on preference pairs."""
