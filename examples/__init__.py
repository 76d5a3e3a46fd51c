"""The example C guests (``*.c``, ``wasi_nn.h``), shipped as package data so that
``wasinn demo`` can build them from an installed wheel too (see wasinn.host.guests)."""
