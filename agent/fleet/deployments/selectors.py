"""Label selectors in Kubernetes' syntax (``fleet deploy --to``), parsed by a small pure
grammar and matched against a device's labels (``agent.fleet.deployments.labels.selectable``).

    selector    := "" | requirement ("," requirement)*
    requirement := KEY | "!" KEY
                 | KEY ("=" | "==" | "!=") VALUE
                 | KEY ("in" | "notin") "(" [VALUE ("," VALUE)*] ")"

As in Kubernetes: requirements are ANDed; ``key != v`` and ``key notin (...)`` also match a
device without ``key``; the empty selector matches every device; whitespace between tokens is
ignored. Keys and values follow ``agent.wire.device_labels``. A bad selector is
``bad_selector`` naming the position. The canonical text (``Selector.text``: requirements
sorted, values sorted) names a deployment's group: two selectors that say the same thing are
the same group.
"""

import re
from typing import List, Mapping, NamedTuple, Optional, Tuple

from agent.errors import AgentError
from agent.wire.device_labels import valid_key, valid_value

MAX_SELECTOR = 2048
MAX_REQUIREMENTS = 32
MAX_VALUES = 64

_TOKEN = re.compile(r"\s*(?:(?P<op>==|!=|=|\(|\)|,|!)|(?P<word>[A-Za-z0-9_./-]+))")


class Requirement(NamedTuple):
    key: str
    op: str  # exists | !exists | = | != | in | notin
    values: Tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        has = self.key in labels
        if self.op == "exists":
            return has
        if self.op == "!exists":
            return not has
        if self.op in ("=", "in"):
            return has and labels[self.key] in self.values
        return not has or labels[self.key] not in self.values  # != and notin

    def text(self) -> str:
        if self.op == "exists":
            return self.key
        if self.op == "!exists":
            return "!" + self.key
        if self.op in ("=", "!="):
            return "{}{}{}".format(self.key, self.op, self.values[0])
        return "{} {} ({})".format(self.key, self.op, ",".join(self.values))


class Selector(NamedTuple):
    requirements: Tuple[Requirement, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements)

    @property
    def text(self) -> str:
        return ",".join(r.text() for r in self.requirements)

    @property
    def keys(self) -> List[str]:
        return sorted({r.key for r in self.requirements})


def _fail(text: str, pos: int, expected: str, found: Optional[str]) -> AgentError:
    return AgentError("bad_selector", "selector {!r} at character {}: expected {}, found {}"
                      .format(text[:200], pos + 1, expected,
                              repr(found) if found is not None else "the end"))


def _tokens(text: str) -> List[Tuple[str, str, int]]:
    out: List[Tuple[str, str, int]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            start = len(text) - len(text[pos:].lstrip())
            raise _fail(text, start, "a key, a value or one of = == != ! , ( )", text[start])
        start = m.start("op") if m.group("op") else m.start("word")
        if m.group("op"):
            out.append(("op", m.group("op"), start))
        else:
            out.append(("word", m.group("word"), start))
        pos = m.end()
    return out


def parse(text: str) -> Selector:
    """``text`` as a Selector; AgentError bad_selector when it is not one."""
    if not isinstance(text, str) or len(text) > MAX_SELECTOR:
        raise AgentError("bad_selector", "expected a selector of at most {} characters, found "
                         "{}".format(MAX_SELECTOR, len(text) if isinstance(text, str)
                                     else type(text).__name__))
    toks = _tokens(text)
    reqs: List[Requirement] = []
    i = 0

    def peek(k: int = 0) -> Optional[Tuple[str, str, int]]:
        return toks[i + k] if i + k < len(toks) else None

    def at() -> int:
        t = peek()
        return t[2] if t else len(text)

    def key() -> str:
        nonlocal i
        t = peek()
        if t is None or t[0] != "word" or not valid_key(t[1]):
            raise _fail(text, at(), "a label key ([PREFIX/]NAME)", t[1] if t else None)
        i += 1
        return t[1]

    def value() -> str:
        nonlocal i
        t = peek()
        if t is not None and t[0] == "word":
            if not valid_value(t[1]):
                raise _fail(text, t[2], "a label value (0-63 of [A-Za-z0-9_.-])", t[1])
            i += 1
            return t[1]
        return ""  # an empty value: "key=" selects key with the empty value, as in Kubernetes

    while i < len(toks):
        t = peek()
        assert t is not None
        if t == ("op", "!", t[2]):
            i += 1
            reqs.append(Requirement(key(), "!exists"))
        else:
            k = key()
            nxt = peek()
            if nxt is None or nxt[1] == ",":
                reqs.append(Requirement(k, "exists"))
            elif nxt[0] == "op" and nxt[1] in ("=", "==", "!="):
                i += 1
                reqs.append(Requirement(k, "!=" if nxt[1] == "!=" else "=", (value(),)))
            elif nxt[0] == "word" and nxt[1] in ("in", "notin"):
                i += 1
                op = nxt[1]
                paren = peek()
                if paren is None or paren[1] != "(":
                    raise _fail(text, at(), "'(' after " + op, paren[1] if paren else None)
                i += 1
                values: List[str] = []
                while True:
                    values.append(value())
                    t2 = peek()
                    if t2 is not None and t2[1] == ",":
                        i += 1
                        continue
                    if t2 is not None and t2[1] == ")":
                        i += 1
                        break
                    raise _fail(text, at(), "',' or ')' in the value list",
                                t2[1] if t2 else None)
                if len(values) > MAX_VALUES:
                    raise _fail(text, at(), "at most {} values".format(MAX_VALUES),
                                str(len(values)))
                reqs.append(Requirement(k, op, tuple(sorted(set(values)))))
            else:
                raise _fail(text, nxt[2], "=, ==, !=, in, notin, ',' or the end", nxt[1])
        t = peek()
        if t is not None:
            if t[1] != ",":
                raise _fail(text, t[2], "',' between requirements", t[1])
            i += 1
            if peek() is None:
                raise _fail(text, len(text), "a requirement after ','", None)
    if len(reqs) > MAX_REQUIREMENTS:
        raise AgentError("bad_selector", "selector {!r}: expected at most {} requirements, "
                         "found {}".format(text[:200], MAX_REQUIREMENTS, len(reqs)))
    return Selector(tuple(sorted(set(reqs))))
