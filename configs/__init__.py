"""wasinn.configs."""
