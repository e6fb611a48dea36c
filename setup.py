"""The optional compiled loops of the warm read path (everything else is in pyproject.toml).

``optional=True``: without a C compiler the build goes on without it and the daemon uses
the numpy versions of the same loops (episerve_server/core/kernel.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("episerve_server.core._kernel",
                             ["server/episerve_server/core/_kernel.c"],
                             extra_compile_args=["-O2"], optional=True)])
