"""Store spec strings: which tiers, how big, and the options every tier shares.

``"memory"``, ``"memory:2GB"``, ``"disk:PATH"``, ``"disk:PATH:50GB"``,
``"redis://HOST:PORT/DB"``, or several joined by commas, fastest first.  Two options
may be listed among them and apply to every tier:

- ``namespace=NAME`` (a tenant): its entries live apart from every other namespace's
  on the same disk directory (``PATH/namespaces/NAME``) or Redis server (keys under
  ``cacheblend.NAME:``, its own passage registry too);
- ``key=SECRET``: sign every entry and reject unsigned ones (see :mod:`.signing`);
  ``CACHEBLEND_STORE_KEY`` in the environment does the same without putting the
  secret in the spec.

Parts are split at commas followed by a tier or an option (``memory``, ``disk:``,
``redis://``, ``namespace=``, ``key=``), so a secret or a Redis password may hold commas.
Error messages never show a secret: a ``key=`` value and a URL's user info read ``***``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from .signing import KEY_ENV, Signer

DEFAULT_MEMORY = "4GB"
DEFAULT_DISK = "20GB"
REDIS_PREFIX = "cacheblend"
_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_OPTIONS = ("namespace", "key")
_PART_START = r"(?:memory\b|disk:|rediss?://|unix://|namespace\s*=|key\s*=)"
_SPLIT = re.compile(rf",(?=\s*{_PART_START})", re.IGNORECASE)


@dataclass(frozen=True)
class StoreOptions:
    """What every tier of one store shares."""

    namespace: str | None = None
    signer: Signer | None = None

    @property
    def redis_prefix(self) -> str:
        return namespaced_prefix(self.namespace)


def namespaced_prefix(namespace: str | None) -> str:
    """The Redis key prefix of a namespace (the default one has the bare prefix)."""
    return REDIS_PREFIX if namespace is None else f"{REDIS_PREFIX}.{check_namespace(namespace)}"


def check_namespace(name: str) -> str:
    if not isinstance(name, str) or not _NAMESPACE.fullmatch(name):
        raise ValueError(f"namespace {name!r}: use 1-64 letters, digits, '_' or '-', starting with a letter or digit")
    return name


def split_spec(spec: str) -> tuple[list[str], StoreOptions]:
    """The tier specs of ``spec`` and its options (the key from the environment if the
    spec has none)."""
    tiers, options = [], {}
    for part in (p.strip() for p in _SPLIT.split(spec)):
        name, eq, value = part.partition("=")
        name = name.strip().lower()  # "KEY = s" is the key too, never a tier name shown in an error
        if eq and name in _OPTIONS:
            if name in options:
                raise ValueError(f"store spec gives {name}= twice")
            if not value.strip():  # an unset template variable must not turn signing off
                raise ValueError(f"store spec gives an empty {name}=")
            options[name] = value.strip()
        elif part:
            tiers.append(part)
    if not tiers:
        raise ValueError(f"store spec {hide_secrets(spec)!r} names no tier")
    secret = options.get("key") or os.environ.get(KEY_ENV) or None
    namespace = check_namespace(options["namespace"]) if "namespace" in options else None
    return tiers, StoreOptions(namespace, Signer(secret) if secret else None)


def hide_secrets(text: str) -> str:
    """``text`` (a spec, or one tier of it) with a ``key=`` secret and a URL's user info
    (a Redis password) shown as ``***``, for error messages and logs."""
    text = re.sub(rf"(^|,)\s*key\s*=.*?(?=,\s*{_PART_START}|$)", r"\1key=***", text, flags=re.IGNORECASE | re.DOTALL)
    return re.sub(r"//[^/@\s]*@", "//***@", hide_password_query(text))


def hide_password_query(text: str) -> str:
    """``text`` with a URL's ``password=`` query argument (redis-py takes one) as ``***``."""
    return re.sub(r"((?:^|[?&])password=)[^&,\s]*", r"\1***", text, flags=re.IGNORECASE)


def is_size(text: str) -> bool:
    try:
        parse_size(text)
        return True
    except ValueError:
        return False


def parse_size(text: str) -> int:
    """'512MB', '2GB', '1GiB' → bytes (a positive, finite size)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    if not num or unit not in units:
        raise ValueError(f"cannot read size {text!r} (examples: 512MB, 2GB, 1GiB)")
    try:
        value = float(num) * units[unit]
    except ValueError as e:
        raise ValueError(f"cannot read size {text!r} (examples: 512MB, 2GB, 1GiB)") from e
    if not unit:  # 'disk:/kv:512' meant 512 bytes: every entry was too large, every write skipped
        raise ValueError(f"size {text!r} has no unit: write e.g. {num}MB or {num}GB ({num}B for bytes)")
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"size {text!r} must be a positive, finite number of bytes (examples: 512MB, 2GB)")
    return int(value)
