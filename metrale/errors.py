"""The exceptions Metrale raises.

Every error the engine raises on purpose is a :class:`MetraleError`. The subclasses that describe
bad input also derive from the matching built-in (``ValueError``, ``TypeError``, ``LookupError``)
so that generic ``except`` clauses keep working.
"""

from __future__ import annotations


class MetraleError(Exception):
    """Base class of every error raised by Metrale."""


class ConfigError(MetraleError, ValueError):
    """An engine option or ``METRALE_*`` environment variable has a bad value."""


class PluginError(MetraleError):
    """A plugin could not be imported, registered or validated.

    The message names the plugin and the distribution that provides it.
    """

    def __init__(self, message: str, *, plugin: str | None = None, distribution: str | None = None):
        super().__init__(message)
        self.plugin = plugin
        self.distribution = distribution


class ContractVersionError(PluginError):
    """A plugin targets a forward-contract version this engine does not implement."""


class UnsupportedModelError(MetraleError, LookupError):
    """No installed family serves the checkpoint's ``architectures`` / ``model_type``."""


class CheckpointError(MetraleError):
    """A checkpoint folder is unreadable, incomplete or has a tensor of the wrong shape."""


class BackendUnavailableError(MetraleError, RuntimeError):
    """The requested device backend cannot run on this machine (for example no CUDA device)."""


class InvalidRequestError(MetraleError, ValueError):
    """A prompt or sampling option is invalid. The message contains the offending value."""


class EmptyPromptError(InvalidRequestError):
    """A prompt has no tokens."""


class TokenOutOfRangeError(InvalidRequestError):
    """A prompt holds a token id outside ``[0, vocab_size)``."""


class PromptTooLongError(InvalidRequestError):
    """A prompt (plus the tokens to generate) does not fit the model's context."""


class UnknownOptionError(InvalidRequestError, TypeError):
    """An option name is not recognised (a misspelt keyword, for example)."""


class TokenizerMissingError(InvalidRequestError):
    """A text prompt was given but the checkpoint has no ``tokenizer.json``."""


class CacheError(MetraleError, RuntimeError):
    """The KV / state cache was used against its rules (double free, foreign slot, ...)."""


class OutOfCacheBlocksError(CacheError):
    """The paged KV cache has no free block left for a sequence."""


class KernelArgumentError(MetraleError, ValueError):
    """A kernel launcher got an array of the wrong dtype, shape or memory layout."""


class NonFiniteStateError(MetraleError, FloatingPointError):
    """A recurrent state holds NaN or infinity between prefill chunks."""


class SchedulerStuckError(CacheError):
    """The scheduler can neither run nor admit any request (the message lists the free blocks
    and slots); raised instead of stepping forever."""


class EngineBusyError(MetraleError, RuntimeError):
    """A generation (or :meth:`~metrale.LLM.score`) was started while another one is running on
    the same :class:`~metrale.LLM`: one runs at a time."""


class QueueFullError(EngineBusyError):
    """An :class:`~metrale.AsyncLLM` already holds as many waiting requests as it accepts
    (``max_num_seqs + max_waiting_requests``): submit again later (the server answers 503 with ``Retry-After``)."""


class EngineClosedError(MetraleError, RuntimeError):
    """The :class:`~metrale.LLM` was closed; it cannot generate any more."""


class RankError(MetraleError, RuntimeError):
    """A rank of a model split over several (``tensor_parallel_size``, :mod:`metrale.backends.executor`)
    could not start, failed a step or went away; the message says which and why. After a failed
    step the engine refuses further steps: close the LLM and build it again."""


class NonFiniteWeightError(CheckpointError):
    """A checkpoint tensor holds NaN or infinity (the message names it)."""


class OpRegistrationError(PluginError):
    """An op or kernel declaration is invalid: a name declared twice, a kernel for an op nobody
    declared, a reference whose parameters differ from the declaration."""


class OpNameClashError(OpRegistrationError):
    """Two plugins declare an op of the same name, or a plugin declares a built-in op's name.

    ``op`` is the name; ``origins`` the plugins that declare it, the first declarer first
    (``"metrale"`` for a built-in op); ``plugin`` and ``distribution`` the one whose declaration
    was refused.
    """

    def __init__(self, message: str, *, op: str, origins: tuple[str, ...], plugin: str | None = None,
                 distribution: str | None = None):
        super().__init__(message, plugin=plugin, distribution=distribution)
        self.op = op
        self.origins = origins


class UnknownOpError(MetraleError, AttributeError):
    """A backend was asked for an op nobody declared, or no kernel of an op applies to a call."""


class KernelMismatchError(MetraleError, AssertionError):
    """A kernel's results differ from its op's reference beyond the op's tolerance."""


class GraphCaptureError(MetraleError, RuntimeError):
    """Work that cannot be recorded into a CUDA graph (it synchronises with the host) was asked
    for while a graph was being recorded."""


class AdapterError(MetraleError, ValueError):
    """A LoRA adapter cannot be served as asked: an unsupported PEFT type or option, a tensor or
    shape the base model does not have, a rank above ``max_lora_rank`` (the message says which)."""


class QuantizationError(CheckpointError):
    """Quantized weights cannot be read or served as stored: inconsistent scales or codes, or
    weights fused into one product that were quantized differently."""


class UnsupportedQuantizationError(QuantizationError, UnsupportedModelError):
    """A checkpoint's ``quantization_config`` (or a ``quantization=`` / ``kv_cache_dtype=`` option)
    names a method, number format or option the engine does not serve; the message names it and
    lists what is served. Such a checkpoint is refused, never loaded as if unquantized."""


class HubError(CheckpointError):
    """A Hugging Face Hub id could not be resolved to a checkpoint folder (the subclasses say why)."""


class HubModelNotFoundError(HubError, LookupError):
    """The Hub has no such model, or no such revision of it (a private model looks the same without
    a token: ``HF_TOKEN``)."""


class HubAccessError(HubError, PermissionError):
    """The model is gated or private and the token given (``HF_TOKEN``, or none) may not read it."""


class HubOfflineError(HubError, ConnectionError):
    """The model is not in the local Hub cache and the Hub cannot be asked: offline mode
    (``HF_HUB_OFFLINE=1``) or no connection."""


class NoSafetensorsError(HubError):
    """The model's weights are not stored as ``.safetensors`` (only ``.bin``, ``.pth`` or ``.gguf``
    files, which the engine does not read)."""
