"""Text that leaves the process as UTF-8, checked where it comes in.

Python keeps bytes that are not UTF-8 as lone surrogates (``surrogateescape``): a file
name from ``os.listdir`` or ``Path.iterdir``, an argument from ``sys.argv``, a value
from ``os.environ``. Such a string works as a dict key, in a log line and in an error's
repr, but it has no UTF-8 form, so whatever must write it out as UTF-8 fails: WASI,
which hands a guest its arguments, environment and paths as UTF-8, and a Prometheus
scrape, whose exposition is UTF-8 (one model name or tenant of that kind failed every
scrape). :func:`utf8_text` refuses such text where a caller gives it, naming what it was.
"""

from __future__ import annotations

from wasinn.configs import shown_name
from wasinn.errors import InvalidArgumentError

#: Why a model's name and a tenant must be UTF-8 (for their ``expected``).
LABEL_REASON = "it names figures that a Prometheus scrape writes as UTF-8"
#: What a model's name and a tenant are expected to be.
LABEL_TEXT = f"UTF-8 text ({LABEL_REASON})"


def has_utf8(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form (no lone surrogate). An ASCII string costs one
    C call: requests' tenants are checked here."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def utf8_text(what: str, text: str, expected: str = LABEL_TEXT) -> str:
    """``text``, when it has a UTF-8 form (:func:`has_utf8`); else InvalidArgumentError
    saying that ``what`` (``"tenant"``, ``"the program name"``) is not valid UTF-8,
    with ``text`` (its repr: the surrogates escaped; cut past 60 characters) and
    ``expected``."""
    if not has_utf8(text):
        raise InvalidArgumentError(
            f"{what} is not valid UTF-8 ({shown_name(text)}): expected {expected}")
    return text
