"""easgd-train's Hydra config tree (no code).

Installed from a wheel this directory is the package ``easgd_lightning.conf`` (the build
copies it there, with ``recipes/`` as its group ``recipe/``), read by Hydra as
``pkg://easgd_lightning.conf``; Hydra's ``pkg://`` source needs this ``__init__.py``.
Where the tree is found in each kind of install: :mod:`easgd_lightning.config_tree`.
"""
