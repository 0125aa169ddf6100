"""``--dashboard-token-file``: one token (named ``dashboard``), or one ``NAME:TOKEN`` per
operator so that the audit trail names who acted; bounded and checked."""

import pytest

from agent.errors import AgentError
from agent.fleet.web import read_token, read_tokens


def test_one_token_or_one_per_operator(tmp_path):
    one = tmp_path / "one"
    one.write_text("Zm9vYmFyYmF6cXV4cXV1eA==\n")
    assert read_tokens(str(one)) == {"dashboard": "Zm9vYmFyYmF6cXV4cXV1eA=="}
    assert read_token(str(one)) == "Zm9vYmFyYmF6cXV4cXV1eA=="
    many = tmp_path / "many"
    many.write_text("# operators\nalice:0123456789abcdef0\n\nbob@ops: fedcba98765432100\n")
    assert read_tokens(str(many)) == {"alice": "0123456789abcdef0",
                                      "bob@ops": "fedcba98765432100"}
    assert read_tokens(None) is None


@pytest.mark.parametrize("text,found", [
    ("short\n", "at least 16 characters"),
    ("alice:short\n", "at least 16 characters"),
    ("", "found 0"),
    ("alice:0123456789abcdef0\nalice:fedcba98765432100\n", "'alice' again"),
    ("".join("op{}:{}\n".format(i, "t" * 16 + str(i)) for i in range(101)), "at most 100"),
])
def test_bad_token_files_are_refused(tmp_path, text, found):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(AgentError) as err:
        read_tokens(str(path))
    assert err.value.code == "bad_argument" and found in err.value.message
