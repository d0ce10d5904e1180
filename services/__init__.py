"""Services: job config, the driver loop, the controller (REST + store), dashboard, CLI."""
