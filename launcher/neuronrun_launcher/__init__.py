"""neuronrun: a torchrun-compatible launcher that maps ranks onto NeuronCores.

The manual is the docstring of :mod:`neuronrun_launcher.run` (``neuronrun --help``).
Importing this package is cheap on purpose: torch is imported only when a job is
actually launched, so ``--help`` and ``--dry-run`` answer instantly.
"""
