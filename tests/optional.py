"""Packages the suite can run without: a GPU node may lack them (fvcore has no wheel, and the node keeps its own
environment). A test that needs one is marked ``needs(name)`` and skips there, naming what is missing."""

import importlib.util

import pytest


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def needs(package: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not installed(package), reason=f"needs {package}, which is not installed here")
