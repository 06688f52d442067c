"""The conformance kit for model-family plugins.

Plugin authors subclass :class:`FamilyConformance` in their test suite, provide a checkpoint and a
reference, and get the checks every family must pass (cache spec, checkpoint coverage, prefill +
decode equal to score, chunked prefill equal to whole prefill, batched and mixed steps equal to
single ones, logits against the reference, the plugins' kernels against their ops' references).
A plugin that adds ops or kernels but no family subclasses :class:`KernelConformance`, the kernel
checks alone (without a GPU, under numba's CUDA simulator: :mod:`metrale.testing.kernel_check`).
The pytest plugin (registered automatically when metrale is installed) provides the
``metrale_plugin_manager`` and ``metrale_cpu_llm`` fixtures.

Nothing here imports torch or transformers; :mod:`metrale.testing.hf` does, for authors whose
reference is Hugging Face transformers.
"""

from metrale.testing.conformance import FamilyConformance, KernelConformance, max_relative_error

__all__ = ["FamilyConformance", "KernelConformance", "max_relative_error"]
