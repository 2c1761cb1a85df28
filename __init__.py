"""scriptserve: serve compiled PyTorch models fast, safely and observably, in pure Python.

The repository's top-level folders are this package's subpackages (setuptools' package-dir
maps them): `scriptserve.archiver` writes and reads model archives, `scriptserve.handlers` runs
inside workers, `scriptserve.server` is the serving process and `scriptserve.training` produces
archives. `python -m scriptserve` is the `scriptserve` command.
"""

from __future__ import annotations

__version__ = "0.1.0"
"""The one version string: the distribution's, the CLIs', the manifests' and the APIs'."""
