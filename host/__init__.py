"""wasinn.host."""
