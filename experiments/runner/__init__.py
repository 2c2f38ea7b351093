"""The ``shoal-run`` runner: its command line (`command`, `arguments`, `cli`), the
backends that hold the workers, the training loop, checkpoints, studies, analyses and the
output folder.

Nothing is imported here: ``shoal-run --help`` loads only `command` and `arguments`, and
must not pay for JAX.
"""
