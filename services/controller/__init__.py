"""The Tally controller: REST API, store, Ray job management and dashboard (`tally serve`).

See docs/controller.md. Modules: settings, tables/store (+ migrations/), schemas,
submission and sweeps (config checks), ray_head/ray_jobs/reconcile (Ray), routes_* and
app (FastAPI), server (uvicorn), static/ (the dashboard).
"""
