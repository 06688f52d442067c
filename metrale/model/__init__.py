"""The plugin API of model families: the forward contract and its hook specifications
(:mod:`metrale.model.hookspecs`), the family base classes (:mod:`metrale.model.family`), the
plugin manager that loads built-in and third-party plugins (:mod:`metrale.model.plugin_manager`)
and the engine's view of a model (:mod:`metrale.model.forward`)."""
