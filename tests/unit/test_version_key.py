"""The one version parser (agent.version_key), as the platform and the engines use it."""

from agent.version_key import version_key


def test_leading_dotted_numbers_only():
    assert version_key("8.6.1.6") == (8, 6, 1, 6)
    assert version_key("10.3.0.post1") == (10, 3, 0)
    assert version_key("8.2.1-1+cuda10.2") == (8, 2, 1)
    assert version_key(" 8.7") == (8, 7)
    assert version_key("unknown") == () and version_key("") == ()


def test_width_cuts_or_pads():
    assert version_key("8.6", 3) == (8, 6, 0)
    assert version_key("8.6.1.6", 3) == (8, 6, 1)
    assert version_key("x", 3) == ()
