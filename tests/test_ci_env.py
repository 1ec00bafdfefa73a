import pytest
from ci_env import in_ci


@pytest.mark.parametrize("value", ["true", "True", "TRUE", "1", "yes", " true\n"])
def test_ci_is_on_in_any_spelling_ci_systems_use(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert in_ci()


@pytest.mark.parametrize("value", [None, "", "false", "False", "0", "no"])
def test_ci_is_off_unset_or_false(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not in_ci()
