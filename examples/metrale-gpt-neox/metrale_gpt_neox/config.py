"""GPT-NeoX's view of ``config.json``: the fields of transformers' ``GPTNeoXConfig``, each read
with its type and bounds, and compared with the tensors' headers before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from metrale.checkpoint import Checkpoint
from metrale.config_fields import ConfigFields
from metrale.errors import CheckpointError
from metrale.rope import RopeParameters, rope_parameters

#: ``hidden_act`` values and the GELU form of each (``approximate`` of ``ops.gelu``): "gelu" is
#: the erf form; the three others are the tanh approximation, written three ways.
GELU_FORMS = {"gelu": "none", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh"}

REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# transformers' GPTNeoXConfig defaults for the fields a config.json may omit.
DEFAULT_ROTARY_PCT = 0.25
DEFAULT_LAYER_NORM_EPS = 1e-5
DEFAULT_MAX_POSITIONS = 2048

#: Tensor names. Checkpoints store the LM head as ``embed_out.weight`` (transformers renames it
#: ``lm_head`` in memory and back on saving); ``lm_head.weight`` is accepted too.
LAYERS = "gpt_neox.layers."
EMBEDDING = "gpt_neox.embed_in.weight"
FINAL_NORM = "gpt_neox.final_layer_norm"
HEAD_NAMES = ("embed_out.weight", "lm_head.weight")


@dataclass(frozen=True)
class GptNeoxConfig:
    """Geometry and options of a GPT-NeoX checkpoint, defaults applied as transformers does."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    layer_norm_eps: float
    #: ``approximate`` argument of ``ops.gelu``: "none" (erf) or "tanh".
    gelu_approximate: str
    use_parallel_residual: bool
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    #: ``rope.rotary_dim`` is the partial rotary width, ``int(head_dim * rotary_pct)``.
    rope: RopeParameters

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str = "config.json") -> "GptNeoxConfig":
        """Read ``config`` (``source`` names it in errors); every field is type- and range-checked."""
        fields = ConfigFields(config, source)
        missing = [name for name in REQUIRED_FIELDS if not fields.has(name)]
        if missing:
            raise CheckpointError(f"{source} lacks {', '.join(missing)}")
        hidden = fields.size("hidden_size")
        heads = fields.size("num_attention_heads")
        if hidden % heads:
            raise fields.error(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        head_dim = hidden // heads
        activation = fields.text("hidden_act", "gelu", choices=tuple(GELU_FORMS))
        return cls(
            vocab_size=fields.size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.size("intermediate_size"),
            num_layers=fields.size("num_hidden_layers"),
            num_heads=heads,
            head_dim=head_dim,
            layer_norm_eps=fields.number("layer_norm_eps", DEFAULT_LAYER_NORM_EPS, positive=True),
            gelu_approximate=GELU_FORMS[activation],
            use_parallel_residual=fields.flag("use_parallel_residual", True),
            attention_bias=fields.flag("attention_bias", True),
            tie_word_embeddings=fields.flag("tie_word_embeddings", False),
            max_position_embeddings=fields.size("max_position_embeddings", DEFAULT_MAX_POSITIONS),
            # Reads rope_parameters / rope_scaling, then the legacy rotary_emb_base and rotary_pct.
            rope=rope_parameters(config, head_dim, default_partial_factor=DEFAULT_ROTARY_PCT, source=source),
        )

    def head_name(self, checkpoint: Checkpoint) -> str | None:
        """The LM head's tensor name, or None when the embedding is the head (tied, and no head
        stored)."""
        for name in HEAD_NAMES:
            if checkpoint.has(name):
                return name
        if self.tie_word_embeddings:
            return None
        raise CheckpointError(f"{checkpoint.path}: config.json's tie_word_embeddings=false implies an LM head "
                              f"{HEAD_NAMES[0]!r}, but the checkpoint has none")

    def check_tensors(self, checkpoint: Checkpoint) -> None:
        """Raise :class:`~metrale.errors.CheckpointError` unless the checkpoint's layer count and
        the shapes of the embedding, the first layer, the final norm and the LM head are the ones
        this config implies. Reads headers only; call it before allocating anything sized by the
        config."""
        c, hidden = self, self.hidden_size
        checkpoint.expect_count(c.num_layers, LAYERS, because=f"num_hidden_layers={c.num_layers}")
        vocab = f"vocab_size={c.vocab_size} hidden_size={hidden}"
        checkpoint.expect_shape(EMBEDDING, (c.vocab_size, hidden), because=vocab)
        head = self.head_name(checkpoint)
        if head is not None:
            checkpoint.expect_shape(head, (c.vocab_size, hidden), because=vocab)
        width = f"hidden_size={hidden}"
        for name in (f"{FINAL_NORM}.weight", f"{FINAL_NORM}.bias"):
            checkpoint.expect_shape(name, (hidden,), because=width)
        layer = f"{LAYERS}0"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            for part in ("weight", "bias"):
                checkpoint.expect_shape(f"{layer}.{norm}.{part}", (hidden,), because=width)
        heads = f"num_attention_heads={c.num_heads} hidden_size={hidden}"
        checkpoint.expect_shape(f"{layer}.attention.query_key_value.weight", (3 * hidden, hidden), because=heads)
        checkpoint.expect_shape(f"{layer}.attention.dense.weight", (hidden, hidden), because=width)
        bias = f"attention_bias={str(c.attention_bias).lower()}"
        for name in ("query_key_value", "dense"):
            checkpoint.expect_tensor(f"{layer}.attention.{name}.bias", c.attention_bias, because=bias)
        mlp = f"intermediate_size={c.intermediate_size} hidden_size={hidden}"
        checkpoint.expect_shape(f"{layer}.mlp.dense_h_to_4h.weight", (c.intermediate_size, hidden), because=mlp)
        checkpoint.expect_shape(f"{layer}.mlp.dense_h_to_4h.bias", (c.intermediate_size,), because=mlp)
        checkpoint.expect_shape(f"{layer}.mlp.dense_4h_to_h.weight", (hidden, c.intermediate_size), because=mlp)
        checkpoint.expect_shape(f"{layer}.mlp.dense_4h_to_h.bias", (hidden,), because=mlp)
