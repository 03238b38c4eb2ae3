"""`platform/` is a folder, never a package: the standard-library module must stay importable."""

import platform


def test_standard_library_platform_module_is_not_shadowed():
    import raylane

    assert platform.system()
    assert hasattr(platform, "python_version")
    assert "platform/raylane" in raylane.__file__
