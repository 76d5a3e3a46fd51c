"""wasinn.scheduler."""
