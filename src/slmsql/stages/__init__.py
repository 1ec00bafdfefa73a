"""One module per `slmsql` command, each a thin `main(cfg)` over the library (the modules beside this package).

The module is the command's name with `-` as `_` (`tiny-model` -> `tiny_model.py`); `configs.STAGES` is the one
list of commands. Stages import the library, never each other.
"""
