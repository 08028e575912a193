"""Shared by every test folder: pytest puts this directory on ``sys.path`` (it holds this
conftest and no ``__init__.py``), so tests import `assertions` (one way to compare NVFP4 tensors
and site records) and `tiny_models` (the one tiny-model fixture) from here."""
