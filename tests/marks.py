"""pytest marks shared by the test modules."""

import shutil

import pytest

needs_graphviz = pytest.mark.skipif(
    shutil.which("dot") is None,
    reason="needs Graphviz's `dot` to render pictures: apt-get install graphviz "
           "(.ci/run installs it)")
