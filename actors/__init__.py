"""wasinn.actors."""
