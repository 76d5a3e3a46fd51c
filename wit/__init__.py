"""wasinn.wit."""
