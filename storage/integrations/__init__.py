"""Framework integrations: dcp-storage plugged into training frameworks.

This is the top layer of the package (docs/architecture.md): it may import every
layer below it (``storage.ops``, ``storage.checkpoint``, ``storage.backends``,
``extensions``), and nothing in ``storage`` imports it (an import-linter contract in
pyproject.toml checks both). There is one module per framework, each the only place
that framework is imported: ``storage.integrations.torchtitan``,
``storage.integrations.torchtune``, ``storage.integrations.torch_checkpointing``,
``storage.integrations.lightning``, ``storage.integrations.torchft``,
``storage.integrations.huggingface`` (with ``folders``, the folder-as-a-checkpoint unit
it drains).
Importing this package imports no framework; importing a framework's module without
that framework installed raises :class:`~extensions.errors.MissingDependencyError`
naming the extra to install (``pip install 'dcp-storage[torchtune]'``).

docs/integrations.md has one tested snippet per framework.
"""
