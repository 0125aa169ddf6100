"""Payload mutators shared by the daemon fuzz tests: byte-level edits of encoded messages and
structural edits of JSON documents, drawing odd values from ``WEIRD_VALUES``.

Every function takes the caller's ``random.Random``, so a seed reproduces a whole run.
"""

import json

# JSON values that break naive handlers: wrong types, extremes, path tricks, NUL, digests.
WEIRD_VALUES = [None, True, 0, -1, 1.5, 1e308, -1e308, 2 ** 70, "", "x" * 300, [], {}, [1, 2],
                {"a": {"b": {"c": []}}}, "int8", "deploy", "../../etc/passwd", "\u0000",
                "0" * 64]


def mutate_bytes(rng, data, max_edits=8):
    """A copy of ``data`` with 1 to ``max_edits`` random byte inserts, deletes or overwrites."""
    data = bytearray(data)
    for _ in range(rng.randint(1, max_edits)):
        op = rng.random()
        if not data or op < 0.3:
            data.insert(rng.randint(0, len(data)), rng.randint(0, 255))
        elif op < 0.6:
            del data[rng.randint(0, len(data) - 1)]
        else:
            data[rng.randint(0, len(data) - 1)] = rng.randint(0, 255)
    return bytes(data)


def mutate_doc(rng, doc, weird=WEIRD_VALUES, extra_keys=("extra", "kind", "cancel", "protocol",
                                                          "x" * 10),
               p_drop=0.1, p_replace=0.15, p_add=0.1):
    """A structurally mutated copy of ``doc``: each key dropped (``p_drop``) or its value
    replaced by one of ``weird`` (``p_replace``), else recursed into; each object gains one of
    ``extra_keys`` with probability ``p_add``; a list item is replaced with probability 0.3."""
    doc = json.loads(json.dumps(doc))

    def walk(node):
        if isinstance(node, dict):
            for key in list(node):
                r = rng.random()
                if r < p_drop:
                    del node[key]
                elif r < p_drop + p_replace:
                    node[key] = rng.choice(weird)
                else:
                    walk(node[key])
            if rng.random() < p_add:
                node[rng.choice(extra_keys)] = rng.choice(weird)
        elif isinstance(node, list) and node and rng.random() < 0.3:
            node[rng.randrange(len(node))] = rng.choice(weird)
    walk(doc)
    return doc
