"""Looking names up the way people type them: case, spaces, '-' and '_' do not matter ("RTX 4090", "rtx_4090",
"rtx-4090" are one name), and a name that matches nothing gets "did you mean" (difflib) instead of a list.

    compact("NVIDIA GeForce RTX-4090")  -> "rtx4090"
    suggestions("a100", ["a100-sxm-40gb", "a100-sxm-80gb", "l4"])  -> ["a100-sxm-40gb", "a100-sxm-80gb"]
"""
from __future__ import annotations

import difflib
import re

VENDOR_WORDS = ("nvidia", "geforce", "amd", "instinct", "tesla", "radeon")
MAX_SUGGESTIONS = 5


def compact(name: str) -> str:
    """Lower case, vendor words dropped, no spaces, '-', '_' or '.'; the key two spellings share."""
    text = name.strip().lower() if isinstance(name, str) else ""
    for word in VENDOR_WORDS:
        text = re.sub(rf"\b{word}\b", " ", text)
    return re.sub(r"[\s_.\-]+", "", text)


def suggestions(name: str, choices, aliases: dict | None = None) -> list[str]:
    """The choices `name` most likely meant: those whose compact form starts with its compact form (a prefix:
    'a100' -> every A100), then difflib's closest (to a choice or to an alias of one: 'h900' is close to the
    alias 'h100'), at most MAX_SUGGESTIONS."""
    key = compact(name)
    if not key:
        return []
    by_key: dict[str, str] = {}
    for choice in choices:
        by_key.setdefault(compact(choice), choice)
    prefixed = [c for k, c in by_key.items() if k.startswith(key) or key.startswith(k) and len(k) >= 3]
    for alias, choice in (aliases or {}).items():
        by_key.setdefault(compact(alias), choice)
    close = [by_key[k] for k in difflib.get_close_matches(key, list(by_key), n=MAX_SUGGESTIONS, cutoff=0.6)]
    return list(dict.fromkeys(prefixed + close))[:MAX_SUGGESTIONS]


def did_you_mean(name: str, choices, listing: str, aliases: dict | None = None) -> str:
    """'; did you mean x, y? (listing)' or '; choose one of ... ' when nothing is close."""
    found = suggestions(name, choices, aliases)
    if found:
        return f"; did you mean {' or '.join(found) if len(found) == 2 else ', '.join(found)}? ({listing})"
    return f"; choose one of {', '.join(choices)}"
