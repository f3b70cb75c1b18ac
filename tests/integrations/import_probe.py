"""Run by ``test_import_path.py`` as ``python -m pytest`` from the repository root, beside a stub
``kernels`` distribution: the installed package must be the one imported, not the root's folder."""

import kernels


def test_the_installed_kernels_package_is_imported():
    assert getattr(kernels, "STUB_DISTRIBUTION", False), kernels.__file__
