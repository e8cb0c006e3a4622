"""JSON strings as regular expressions (Python ``re`` syntax, readable by interegular): a string's
characters, the string formats, and strings other than given words (``schema_regex.py``'s pieces).

``FORMATS``: each string format's language on the exact path, written here. Those not in
``SUBSET_FORMATS`` are the languages llguidance generates (it writes a format's string raw, without
escapes): ``time`` with a leap second, a fraction and the zone ``Z``, ``z`` or an offset; ``email``
RFC 5321's mailbox (a dot-string local part, ``@``, then dot-separated domain labels or an IPv4
literal in brackets); ``hostname`` labels of at most 63 characters; ``uuid`` and ``ipv4``.
``date`` and ``date-time`` are strict subsets, so that every date validates: llguidance's dates
take 29 February in any year and the year 0000 (``SUPERSET_FORMATS`` has llguidance's languages).
``tests/test_string_facets.py`` checks that the exact ones' masks equal llguidance's along random
strings of each format, ``tests/test_structured_paths.py`` that the supersets contain them.
"""

from __future__ import annotations

import re

from .regex_numbers import _alt

CHAR = r'(?:[^"\\\x00-\x1f\x7f]|\\["\\bfnrt]|\\u00[01][0-9a-fA-F]|\\u007[fF])'
_LOCAL_CHAR = r"[a-zA-Z0-9!#$%&'*+/=?^_`{|}~-]"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# llguidance's date: every month its own days, 29 February in any year, the year 0000 too
_LLG_DATE = (r"[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
             r"|02-(?:0[1-9]|[12][0-9]))")
# the exact path's: no 29 February and no year 0000, so every date validates (a subset)
_DATE = (r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])"
         r"|(?:0[13-9]|1[0-2])-(?:29|30)|(?:0[13578]|1[02])-31)")
# a leap second, a fraction, the zone Z, z or an offset
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_IPV4 = _OCTET + r"(?:\." + _OCTET + "){3}"
_HOST_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "[tT]" + _TIME,
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": _IPV4,
    "email": _LOCAL_CHAR + r"+(?:\." + _LOCAL_CHAR + r"+)*@(?:" + _LABEL + r"(?:\." + _LABEL + r")*|\[" + _IPV4 + r"\])",
    "hostname": _HOST_LABEL + r"(?:\." + _HOST_LABEL + ")*",
}
SUBSET_FORMATS = frozenset({"date", "date-time"})  # (strict subsets of llguidance's languages)
# the superset path's: llguidance's language of each format (the superset takes a format beside a
# length or a pattern as the format alone)
SUPERSET_FORMATS = {**FORMATS, "date": _LLG_DATE, "date-time": _LLG_DATE + "[tT]" + _TIME}


# any JSON string (every escape): the superset's keys and widened strings
ANY_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
ANY_STRING = '"' + ANY_CHAR + '*"'


_ESCAPES = '"\\/bfnrt'


def string_except(words: list[str]) -> str:
    """A regex of the JSON strings (quotes included, any escapes) other than the texts ``words``
    (JSON string literals, e.g. ``json.dumps(name)``), written out over a trie of their characters;
    any JSON string (a superset) where a word holds a \\u escape."""
    trie: dict = {}
    for w in dict.fromkeys(words):
        units = re.findall(r'\\u[0-9a-fA-F]{4}|\\.|[^\\]', w[1:-1])
        if any(u.startswith("\\u") for u in units):
            return ANY_STRING
        node = trie
        for u in units:
            node = node.setdefault(u, {})
        node[None] = True  # (a word ends here)
    return '"' + _not_in(trie)


def _not_in(node: dict) -> str:
    """The rest of a string (closing quote included) after a prefix that reached ``node``, keeping
    out the words that continue from there."""
    options = [] if node.get(None) else ['"']
    raw = [u for u in node if u is not None and not u.startswith("\\")]
    esc = [u[1] for u in node if u is not None and u.startswith("\\")]
    other = ["[^\"\\\\\\x00-\\x1f" + "".join(re.escape(c) for c in raw) + "]"]
    if set(_ESCAPES) - set(esc):
        other.append("\\\\[" + "".join(re.escape(c) for c in _ESCAPES if c not in esc) + "]")
    other.append("\\\\u[0-9a-fA-F]{4}")
    options.append(_alt(other) + ANY_CHAR + '*"')
    options += [literal(u) + _not_in(child) for u, child in node.items() if u is not None]
    return _alt(options)


def literal(text: str) -> str:
    """``text`` as a regex that matches it literally (Python syntax, readable by interegular)."""
    return re.sub(r"([\\.^$*+?{}\[\]|()\-/])", r"\\\1", text)
