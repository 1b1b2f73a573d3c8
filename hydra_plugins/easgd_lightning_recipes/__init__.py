"""easgd-lightning's recipes in a checkout: ``recipes/`` as Hydra's config group ``recipe``
(:mod:`.source`; where the config tree is in each kind of install:
:mod:`easgd_lightning.config_tree`)."""
