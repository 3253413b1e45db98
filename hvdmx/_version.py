"""hvdmx's version, in one place: ``hvdmx.__version__``, ``hvdmxrun --version``,
and the distribution's (pyproject.toml reads it from here: its
[tool.setuptools.dynamic]), so the wheel's and the sdist's names. Change it here
only, with a new section in CHANGELOG.md."""
__version__ = "0.1.0"
