"""Hugging Face model directories, pure (no JAX, no PyTorch, no ``transformers``): a base-level
package, below ``jaxmem.model``.

- ``config``: ``config.json`` <-> ``ModelConfig``, ``--preset DIR``, what agrees with a directory;
- ``keys``: the one key-and-shape map between jaxmem's parameter tree and PyTorch's names,
  Hugging Face's and torch_ref's (``jaxmem.compare.weights`` uses it too);
- ``files``: safetensors weights read into the parameter tree and written back (the
  ``safetensors`` library), a new model directory written whole or not at all;
- ``tokenizer``: the byte tokenizer and a directory's ``tokenizer.json``.

The JAX end, a ``Decoder`` loaded from or exported to a directory, is ``jaxmem.model.hf`` (it
needs the model, one level up). Import submodules directly; this package imports nothing.
"""
