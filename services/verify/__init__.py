"""The verifiers as programs: ``verify-aggregation`` (aggregation.py) draws one rollout
and holds every layout's gradients and J to the reference layout's (trainer/verify.py),
with a critic's part for PPO (critic.py). Errors a test plants are handed in as
``{layout: Planted}`` (trainer/planted.py), never read from the environment here."""
