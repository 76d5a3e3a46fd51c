"""The host's environment variables an operator gives confined sandbox processes besides
those every one is given (``[runtime] sandbox_env``; the default allowlist is
:data:`~._sandbox_process.CONFINED_ENV_NAMES` and
:data:`~._sandbox_process.CONFINED_ENV_PREFIXES`).

A library may read a variable no list foresees (an OpenVINO plug-in's configuration
path, ``HF_HOME``, a site's ``MY_LICENSE_FILE``): a confined process is not given it,
and the model behaves otherwise there than in the host's process. The operator names
such variables, each by an exact name (``HF_HOME``) or a prefix ending in ``*``
(``MY_LICENSE_*``); a bare ``*``, the host's whole environment, is refused: its keys and
tokens are what the allowlist keeps from a process that a model may have compromised.
So is a prefix of fewer than :data:`MIN_PREFIX` characters (``A*``, ``_*``), which
matches nearly as much. And a prefix never gives a variable whose name looks like a
credential (:func:`looks_like_credential`: ``HF_*`` would give ``HF_TOKEN``, Hugging
Face's access token, beside ``HF_HOME``): only its exact name does, the operator having
meant it. A name says nothing of a value (``DATABASE_URL`` may hold a password): a
prefix is a convenience for the harmless; name exactly what a library needs.

A few variables a confined process is always given values of its own for
(:data:`OWN_VALUES`): named exactly they are refused; matched by a prefix, the process's
own value wins.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: An entry: a variable's name (as POSIX shells write them), or a prefix ending in ``*``.
_ENTRY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
#: The fewest characters a prefix has before its ``*``.
MIN_PREFIX = 2
#: What, anywhere in a variable's name (whatever its case), makes it look like a
#: credential: the words of Django's error pages, which hide the settings whose names
#: hold them (``TOKEN``, ``KEY``, ``SECRET``, ``PASS``, ``SIGNATURE``; not their ``API``,
#: which ``CUDA_API_PER_THREAD_DEFAULT_STREAM`` holds, and an API's key holds ``KEY``),
#: and those the Sentry SDK's default list of fields to scrub adds (``AUTH``,
#: ``CREDENTIAL``, ``PRIVATE``, ``PWD``, ``COOKIE``, ``SESSION``). Broad on purpose: a
#: variable held back wrongly is given by naming it exactly; one given wrongly is a leak.
#: It applies to the default prefixes too (:data:`._sandbox_process.CONFINED_ENV_PREFIXES`:
#: ``NVIDIA_API_KEY`` is held back).
CREDENTIAL_WORDS = ("TOKEN", "KEY", "SECRET", "PASS", "SIGNATURE", "AUTH",
                    "CREDENTIAL", "PRIVATE", "PWD", "COOKIE", "SESSION")
_CREDENTIAL = re.compile("|".join(CREDENTIAL_WORDS), re.IGNORECASE)

#: The variables a confined process is given values of its own for, whatever the host's
#: (see :class:`~._sandbox_process.SandboxProcess`), and what it is given.
OWN_VALUES = {
    "HOME": "its private folder, the one folder it may write in",
    "TMPDIR": "its private folder, the one folder it may write in",
    "XDG_CACHE_HOME": "its private folder, the one folder it may write in",
    "PYTHONPATH": "wasinn's and its backend's folders, not the host's import path",
}


def env_pattern_problem(entry: object) -> str | None:
    """What is wrong with ``entry`` as one of the variables given to confined processes
    (a sentence that says what was expected), or None: it is right."""
    if not isinstance(entry, str):
        return (f"{entry!r:.60} is not a string: expected an environment variable's name "
                'such as "HF_HOME", or a prefix ending in * such as "MY_LICENSE_*"')
    if entry == "*":
        return ('"*" would give a confined sandbox process the host\'s whole environment, '
                "its keys and tokens included, which the confinement keeps from a process "
                "that a model may have compromised: name the variables (or prefixes such "
                'as "MY_LICENSE_*"), or run a model that needs all of it with sandbox = '
                "false (in the host's process)")
    if not _ENTRY.fullmatch(entry):
        return (f"{entry!r:.60} is not a variable's name: expected letters, digits and _ "
                "(not a digit first), optionally followed by one * that makes it a prefix "
                '(such as "MY_LICENSE_*"; * only at the end)')
    if entry.endswith("*") and len(entry) - 1 < MIN_PREFIX:
        return (f"{entry!r} would give a confined sandbox process nearly as much of the "
                'host\'s environment as "*" (every variable that begins with '
                f"{entry[:-1]!r}), which the confinement keeps from a process that a model "
                f"may have compromised: expected a prefix of at least {MIN_PREFIX} "
                'characters before the * (such as "MY_LICENSE_*"), or the variables\' names')
    if entry in OWN_VALUES:
        return (f"a confined sandbox process is always given its own {entry} "
                f"({OWN_VALUES[entry]}), never the host's: expected another variable")
    return None


def env_patterns(entries: Iterable[str]) -> tuple[str, ...]:
    """``entries`` as a tuple, each checked (ValueError naming the first that is wrong, see
    :func:`env_pattern_problem`; TypeError for one string, not a list of them)."""
    if isinstance(entries, str):
        raise TypeError(f"extra_env={entries!r:.60}: expected a list of names, not a string")
    patterns = tuple(entries)
    for i, entry in enumerate(patterns):
        problem = env_pattern_problem(entry)
        if problem is not None:
            raise ValueError(f"extra_env[{i}]: {problem}")
    return patterns


def looks_like_credential(name: str) -> bool:
    """Whether variable ``name`` looks like it holds a credential: it holds one of
    :data:`CREDENTIAL_WORDS`, whatever its case (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``,
    ``OPENAI_API_KEY``, ``PGPASSWORD``)."""
    return _CREDENTIAL.search(name) is not None


def given(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether variable ``name`` is one that ``patterns`` give: named exactly, or matched
    by a prefix ending in ``*`` and not :func:`looks_like_credential` (see
    :func:`held_back`)."""
    return name in patterns or (_prefixed(name, patterns) and not looks_like_credential(name))


def held_back(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether variable ``name`` is one that a prefix of ``patterns`` matches but that is
    not given, as it looks like a credential and is not named exactly."""
    return name not in patterns and _prefixed(name, patterns) and looks_like_credential(name)


def _prefixed(name: str, patterns: tuple[str, ...]) -> bool:
    return any(pattern.endswith("*") and name.startswith(pattern[:-1])
               for pattern in patterns)
